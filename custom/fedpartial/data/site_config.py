"""Where a site's data lives.

A job names a dataset (``dataset.name``); each site resolves that name to its own data root and manifests,
in this order:

1. the JSON file named by the environment variable ``FEDPARTIAL_SITE_CONFIG``, or else
2. ``<site workspace>/local/fedpartial_data.json``, both of the form::

       {"datasets": {"rsna_ich": {"data_root": "/data/rsna", "train": "manifests/train.csv",
                                  "val": "manifests/val.csv", "test": "manifests/test.csv"}}}

   (relative paths are relative to the JSON file's folder; ``val`` / ``test`` are optional; ``columns`` maps
   the site's own column names to the job's classes and ``ignore_columns`` lists columns to skip, see
   :mod:`fedpartial.data.vocabulary`);
3. in the simulator only, each site's own ``--sites 1`` prepared folder named by ``dataset.site_data``
   (``{"site-1": folder, ...}``: ``job.py --site-data``; each site trains and scores its own sets, as real sites
   do), else a prepared folder (``fedpartial-prepare`` output) named by ``dataset.prepared``, else a
   simulated split prepared on first use from the job's ``dataset.prepare`` spec (sites ``site-1 .. site-N``
   take ``site-<i>.csv``: each site its own manifest). Real (provisioned / POC) sites need 1. or 2.; the
   environment can force either way: ``FEDPARTIAL_REQUIRE_SITE_CONFIG=1`` (or ``dataset.require_site_config:
   true``) also in the simulator, ``FEDPARTIAL_REQUIRE_SITE_CONFIG=0`` lets a POC demo fall back to the
   simulated split.

Anything else is a :class:`SiteDataError` naming the site.

Relative paths in a job's dataset config (``prepare.root``, ``prepared``) resolve against the data anchor
(:func:`data_anchor`): ``$FEDPARTIAL_DATA_DIR`` when set (a recipe's ``data_dir`` / a ``job.py``'s
``--data-dir`` sets it for its simulated sites), else the checkout this package runs from (the folder holding
``jobs/`` and ``custom/fedpartial``), else the working folder. Never the simulated site's workspace: a job run
from anywhere finds ``../shared/data/...`` next to the checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

from .cache import CACHE_ENV, cache_dir  # noqa: F401 - where prepared splits and stores are kept
from .prepare import ensure_prepared
from .prepared import DATASET_JSON, check_job_classes, load_prepared
from .site_files import (  # noqa: F401
    DATA_DIR_ENV,
    SITE_CONFIG_ENV,
    SITE_CONFIG_FILE,
    SiteData,
    SiteDataError,
    data_anchor,
    data_source,
    missing_root,
    read_site_config,
    resolve_path,
)
from .sources.base import SourceError

REQUIRE_ENV = "FEDPARTIAL_REQUIRE_SITE_CONFIG"


def _site_config_file(local_dir: str | os.PathLike | None) -> Path | None:
    env = os.environ.get(SITE_CONFIG_ENV)
    if env:
        return Path(env).expanduser()
    if local_dir is not None and (Path(local_dir) / SITE_CONFIG_FILE).is_file():
        return Path(local_dir) / SITE_CONFIG_FILE
    return None


def simulated_spec(dataset: dict) -> dict:
    """The :func:`~fedpartial.data.prepare.ensure_prepared` spec of a job's simulated split."""
    # a job overrides a preset's protocol parameter away with null (e.g. {"protocol": "full", "k": null})
    spec = {k: v for k, v in dataset["prepare"].items() if v is not None or k == "root"}
    # the sites' image stores decode every image once (and report a bad one at its manifest line), within the
    # data check's time or before the job (fedpartial-store): prepare-on-first-use need not decode them too
    spec.setdefault("decode_images", False)
    if spec.get("root") is not None:
        spec["root"] = str(resolve_path(spec["root"]))
    return spec


def _from_site_data(site: str, dataset: dict) -> SiteData:
    """A simulated site's own ``--sites 1`` prepared folder (``dataset.site_data[site]``): its manifest, its own
    val / test sets, its data root."""

    given = dataset["site_data"]
    if site not in given:
        raise SiteDataError(
            f"site '{site}' has no folder in the job's site data (sites: {sorted(given)}); run with "
            f"{len(given)} sites, or give it one: --site-data {site}=FOLDER"
        )
    folder = resolve_path(given[site])
    if not (folder / DATASET_JSON).is_file():
        raise missing_root(site, dataset["name"], f"site_data[{site!r}]", given[site], folder / DATASET_JSON)
    prepared = load_prepared(folder)
    if len(prepared.sites) != 1:
        raise SiteDataError(
            f"site '{site}': {folder} holds {len(prepared.sites)} sites {sorted(prepared.sites)}; "
            "--site-data takes a folder prepared for one site (fedpartial-prepare --sites 1)"
        )
    try:
        check_job_classes(prepared, dataset.get("classes"), f"site '{site}', dataset '{dataset['name']}': ")
    except SourceError as e:
        raise SiteDataError(str(e)) from None
    (train,) = prepared.sites.values()
    vocab = next(iter((prepared.info.get("vocabularies") or {}).values()), {})
    return SiteData(
        site,
        dataset["name"],
        prepared.data_root,
        train,
        prepared.val,
        prepared.test,
        origin=f"site-data:{folder}",
        synthetic=bool(prepared.info.get("synthetic")),
        columns=dict(vocab),
        source=data_source(train, prepared.info),
    )


def simulated_site_data(site: str, dataset: dict) -> SiteData:

    if dataset.get("site_data"):  # each simulated site its own separately prepared folder
        return _from_site_data(site, dataset)
    if dataset.get("prepared"):  # a fedpartial-prepare folder, run as it is: each site its own manifest
        folder = resolve_path(dataset["prepared"])
        if not (folder / DATASET_JSON).is_file():
            raise missing_root(site, dataset["name"], "prepared", dataset["prepared"], folder / DATASET_JSON)
    else:
        spec = simulated_spec(dataset)
        root = dataset["prepare"].get("root")
        if root is not None and not Path(spec["root"]).exists():  # a folder, or a file (a CSV source's CSV)
            raise missing_root(site, dataset["name"], "prepare.root", root, Path(spec["root"]))
        folder = ensure_prepared(spec, cache_dir())
    prepared = load_prepared(folder)
    try:
        check_job_classes(prepared, dataset.get("classes"), f"site '{site}', dataset '{dataset['name']}': ")
    except SourceError as e:
        raise SiteDataError(str(e)) from None
    if site not in prepared.sites:
        raise SiteDataError(
            f"site '{site}' is not one of the simulated sites {sorted(prepared.sites)} of dataset "
            f"'{dataset['name']}' (prepared in {folder}); run with that many clients or give this site a "
            f"{SITE_CONFIG_FILE}"
        )
    vocab = (prepared.info.get("vocabularies") or {}).get(site) or {}  # a split written in several vocabularies
    return SiteData(
        site,
        dataset["name"],
        prepared.data_root,
        prepared.sites[site],
        prepared.val,
        prepared.test,
        origin=f"simulated:{folder}",
        synthetic=bool(prepared.info.get("synthetic")),
        columns=dict(vocab),
        source=data_source(prepared.sites[site], prepared.info),
    )


def site_config_required(dataset: dict, simulated: bool = True) -> bool:
    """Whether a site must have its own data configuration (see the module docstring)."""
    env = os.environ.get(REQUIRE_ENV, "").strip().lower()
    if dataset.get("require_site_config") or env in ("1", "true", "yes"):
        return True
    return False if env in ("0", "false", "no") else not simulated


def resolve_site_data(
    site: str, dataset: dict, local_dir: str | os.PathLike | None = None, simulated: bool = True
) -> SiteData:
    """Resolve the job's dataset for this site (see the module docstring for the order).

    ``simulated``: the site runs in NVFlare's simulator (only then may it fall back to a simulated split).
    """
    name = dataset["name"]
    file = _site_config_file(local_dir)
    if file is not None:
        return read_site_config(site, name, file, dataset.get("classes"))
    if (dataset.get("prepare") or dataset.get("prepared") or dataset.get("site_data")) and not site_config_required(
        dataset, simulated
    ):
        return simulated_site_data(site, dataset)
    where = f"{Path(local_dir) / SITE_CONFIG_FILE}" if local_dir else f"local/{SITE_CONFIG_FILE}"
    raise SiteDataError(
        f"site '{site}' has no data configured for dataset '{name}': create {where} "
        f"(or point ${SITE_CONFIG_ENV} at such a file) with "
        f'{{"datasets": {{"{name}": {{"data_root": ..., "train": ..., "val": ..., "test": ...}}}}}}'
    )
