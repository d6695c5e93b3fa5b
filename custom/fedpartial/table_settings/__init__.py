"""The shared settings of each results table's jobs, one small constants module per table (as FLamby keeps a
dataset's constants): a ``jobs/<name>/job.py`` takes its table's settings from here and names only what differs
(the method, its options, a variant of the data)::

    from functools import partial

    from fedpartial.recipes import PartialLabelRecipe
    from fedpartial.table_settings import ich_phantom

    recipe = partial(PartialLabelRecipe, **ich_phantom.SETTINGS, name="fedavg_ich", method="fedavg")

Each module's ``SETTINGS`` (or ``settings(...)``) are recipe keyword arguments (:mod:`fedpartial.recipes`); a
job replaces one with ``**{**SETTINGS, "dataset": ...}``. A value changed here changes every job of the table:
``make jobs`` re-exports them.

- :mod:`.ich_phantom`: the ICH phantom, 5 sites, missing 4 classes, 20 rounds.
- :mod:`.ham10000_fedlsm_split`: HAM10000 on FedLSM's label-set split (5 sites x 3 classes), 20 rounds, from
  ImageNet (EfficientNet-Lite0).
- :mod:`.nih_cxr14_missing_7`: NIH ChestX-ray14, 8 sites, missing 7 classes, 20 rounds.
- :mod:`.fedirm_isic`: FedIRM's Table 1 (10 sites, 2 labelled), its baselines (from ImageNet on HAM10000) and the
  ICH variant.
- :mod:`.fedlsm`: FedLSM's optimiser and AWPA (its HAM10000 and ChestX-ray14 jobs).
- :mod:`.fedmlp_paper`: FedMLP's published configuration (ResNet-18, 500 rounds) on RSNA ICH and ChestX-ray14.
- :mod:`.surgical`: surgical aggregation's model head, warm-up and model selection (and its PFL baseline).
"""
