"""Before any training: every site validates its data and reports what it annotates.

- :class:`DataSummaryProcessor` (a ``ResponseProcessor`` for NVFlare's ``BroadcastAndProcess`` workflow) sends
  the server's job spec (method, resolved options, model architecture) to every site, stops the job with the
  site's own error (site, file, line) when a manifest is bad or the site's job configuration differs from the
  server's, refuses a class list that differs from the server's, checks that every class is annotated by some
  site and that the federation suits the method (the rule's ``check_federation``, e.g. FedIRM needs labelled
  and unlabelled sites), and logs the per-site table of annotated positives.
- :class:`SummaryFilter` (a server task-data filter) attaches that summary to every ``train`` task, so methods
  that need global label statistics (FedLSM's class weights, FedMLP's global positive rates) have them from
  round 0 on.
"""

from __future__ import annotations

import numpy as np
from nvflare.apis.client import Client
from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.response_processor import ResponseProcessor

from ..data.manifest import ManifestError, check_coverage
from .keys import META_SPEC, META_SUMMARY
from .spec import job_spec
from ..models import ARCH_OPTIONS


def summary_table(summary: dict) -> str:
    """Per-site annotated positives per class ('-' where the site does not annotate the class)."""
    classes = summary["classes"]
    width = max(8, *(len(c) for c in classes))
    lines = ["site".ljust(10) + "n".rjust(7) + "".join(c[:width].rjust(width + 1) for c in classes)]
    for site, s in sorted(summary["sites"].items()):
        cells = [str(p) if a else "-" for p, a in zip(s["positives"], s["annotated"])]
        lines.append(site[:10].ljust(10) + str(s["n_train"]).rjust(7) + "".join(c.rjust(width + 1) for c in cells))
    return "\n".join(lines)


class DataSummaryProcessor(ResponseProcessor):
    """Args:
        classes: the job's class list (every site must use it).
        aggregator_id, model_id: the components whose method / options and model architecture make the job spec
            sent to the sites (absent components: no spec check).
    """

    def __init__(self, classes: list[str] | None = None, aggregator_id: str = "aggregator", model_id: str = "model"):
        super().__init__()
        self.classes, self.aggregator_id, self.model_id = classes, aggregator_id, model_id
        self.summary: dict | None = None
        self._sites: dict[str, dict] = {}
        self.error: str | None = None

    def _fail(self, fl_ctx: FLContext, error: str) -> bool:
        self.error = error
        self.log_error(fl_ctx, f"DATA CHECK FAILED: {error}")
        self.system_panic(f"data check failed: {error}", fl_ctx)
        return False

    def _spec(self, fl_ctx: FLContext) -> dict | None:
        engine = fl_ctx.get_engine()
        agg, model = engine.get_component(self.aggregator_id), engine.get_component(self.model_id)
        if agg is None or getattr(agg, "rule", None) is None:
            return None
        arch = {k: getattr(model, k) for k in ARCH_OPTIONS if hasattr(model, k)} if model is not None else {}
        return job_spec(agg.method, agg.method_args, arch)

    def create_task_data(self, task_name: str, fl_ctx: FLContext) -> Shareable:
        self._sites, self.summary, self.error = {}, None, None
        task = Shareable()
        spec = self._spec(fl_ctx)
        if spec is not None:
            task[META_SPEC] = spec
        return task

    def process_client_response(self, client: Client, task_name: str, response: Shareable, fl_ctx: FLContext) -> bool:
        rc = response.get_return_code()
        if rc and rc != ReturnCode.OK:
            return self._fail(fl_ctx, response.get_header("error")
                              or f"site '{client.name}' failed the data check (return code {rc})")
        info = from_shareable(response).get_meta_prop(META_SUMMARY)
        if self.classes is not None and list(info["classes"]) != list(self.classes):
            return self._fail(fl_ctx, f"site '{client.name}' uses classes {info['classes']}, the server expects "
                                      f"{self.classes}")
        self._sites[client.name] = info
        return True

    def final_process(self, fl_ctx: FLContext) -> bool:
        if not self._sites:
            return self._fail(fl_ctx, "no site answered the data check")
        classes = self.classes or next(iter(self._sites.values()))["classes"]
        summary = {"classes": list(classes), "sites": self._sites}
        agg = fl_ctx.get_engine().get_component(self.aggregator_id)
        try:
            check_coverage({s: np.asarray(i["annotated"], bool) for s, i in self._sites.items()}, classes)
            if getattr(agg, "rule", None) is not None:
                agg.rule.check_federation(summary)
        except (ManifestError, ValueError) as e:
            return self._fail(fl_ctx, str(e))
        self.summary = summary
        if any(i.get("synthetic") for i in self._sites.values()):
            self.log_warning(fl_ctx, "*** SYNTHETIC DATA: the sites train on a generated phantom, not real scans ***")
        self.log_info(fl_ctx, "annotated positives per site and class:\n" + summary_table(self.summary))
        return True


class SummaryFilter(DXOFilter):
    """Adds the data summary (component ``summary_id``) to the meta of outgoing task data."""

    def __init__(self, summary_id: str = "data_summary"):
        super().__init__(supported_data_kinds=None, data_kinds_to_filter=None)
        self.summary_id = summary_id

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        comp = fl_ctx.get_engine().get_component(self.summary_id)
        summary = getattr(comp, "summary", None)
        if summary is not None:
            dxo.set_meta_prop(META_SUMMARY, summary)
        return dxo
