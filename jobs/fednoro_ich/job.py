"""fednoro_ich — FedNoRo on the ICH phantom (5 sites, missing 4; SYNTHETIC images), FedMLP's comparison (README.md).

Run: ``python jobs/fednoro_ich/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="fednoro_ich",
    method="fednoro",
    dataset="ich_phantom",
    num_sites=5,
    num_rounds=20,
    method_args={"all_noisy": True, "ramp_begin": 0, "ramp_end": 19},
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
