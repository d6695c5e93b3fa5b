"""The HAM10000 table on FedLSM's label-set split (README.md "Jobs": 5 sites x 3 classes, single-label; the
``ham10000`` preset's ``fedlsm_isic`` table), 20 rounds, the recipe's default model and training; the table:
``benchmarks/fedlsm_ham10000.sh``.
"""

SETTINGS = dict(dataset="ham10000", num_sites=5, num_rounds=20)
ALL_LABELS = {"preset": "ham10000", "prepare": {"protocol": "full", "table": None}}  # the upper bound's data
