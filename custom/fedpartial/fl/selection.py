"""Best-model selection on the server: NVFlare's ``IntimeModelSelector`` over the validation metric the sites
report with their updates, where a site that did not score a validation set this round (evaluation once per
image: another site scored the shared set) is simply not counted, instead of a warning per site and round."""

from __future__ import annotations

from nvflare.apis.dxo import MetaKey, from_shareable
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.widgets.intime_model_selector import IntimeModelSelector


class ModelSelector(IntimeModelSelector):
    """``IntimeModelSelector`` (same arguments) that skips, silently, updates carrying no validation metrics."""

    def _before_accept(self, fl_ctx: FLContext):
        peer = fl_ctx.get_peer_context()
        try:
            meta = from_shareable(peer.get_prop(FLContextKey.SHAREABLE)).meta or {}
        except Exception:  # noqa: BLE001 - the parent reports a broken update
            return super()._before_accept(fl_ctx)
        if meta.get(self.validation_metric_name or MetaKey.INITIAL_METRICS) is None:
            return False
        return super()._before_accept(fl_ctx)
