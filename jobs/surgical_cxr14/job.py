"""surgical_cxr14 — surgical aggregation on real NIH chest X-rays (4 sites, 7 of 14 findings each) (README.md).

Run: ``python jobs/surgical_cxr14/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import SurgicalRecipe, job_main

JOB = dict(
    name="surgical_cxr14",
    dataset={
        "preset": "nih_cxr14",
        "classes": [
            "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
            "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia",
        ],
        "prepare": {
            "classes": [
                "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
                "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening",
                "Hernia",
            ],
            "protocol": "missing_k",
            "k": 7,
        },
    },
    num_sites=4,
    key_metric="site_bce",  # the paper selects the model with the lowest mean local validation BCE
    num_rounds=20,
    model={"arch": "small_cnn", "in_channels": 1, "head_hidden": 256, "head_dropout": 0.3},
    warmup_epochs=15,
    warmup_lr=0.005,
    norm="local",
)


def recipe(**overrides) -> SurgicalRecipe:
    """The job's recipe (``overrides``: any SurgicalRecipe keyword, e.g. ``num_rounds=2``)."""
    return SurgicalRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
