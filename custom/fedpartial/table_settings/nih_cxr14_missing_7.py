"""The NIH ChestX-ray14 table (README.md "Jobs"): FedMLP's protocol on the shipped 1,000-image sample, 8 sites
each annotating one of the 8 most frequent findings (missing 7), 20 rounds, the recipe's default model and training.
"""

SETTINGS = dict(dataset={"preset": "nih_cxr14", "prepare": {"num_sites": 8, "k": 7}}, num_sites=8, num_rounds=20)
