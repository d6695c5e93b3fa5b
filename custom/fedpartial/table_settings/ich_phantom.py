"""The ICH phantom table (README.md "Jobs": ICH phantom, missing 4): 5 sites each annotating one of the 5 subtypes
(the preset's ``missing_k`` protocol, k = 4), 20 rounds, the recipe's default model and training. SYNTHETIC images.
"""

SETTINGS = dict(dataset="ich_phantom", num_sites=5, num_rounds=20)
ALL_LABELS = {"preset": "ich_phantom", "prepare": {"protocol": "full", "k": None}}  # the upper bound's data
