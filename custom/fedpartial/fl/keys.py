"""Names of the metadata that travels between sites and server (one name per concept)."""

META_SUMMARY = "fedpartial_data_summary"  # server -> sites: every site's annotated counts
META_N_TRAIN = "n_train"  # site -> server: training-set size (FedAvg weight)
META_ANNOTATED = "annotated"  # site -> server: (C,) bool classes annotated at the site
META_CLASSIFIER_KEYS = "classifier_keys"  # site -> server: state-dict keys of the classifier rows
META_RESULTS = "fedpartial_results"  # site -> server: full metric dicts of the received model
META_TEST = "test_metrics"  # site -> server: flat test metrics of the received model
STATE_FILE = "trainer_state.pt"
# the server's global model files (PTFileModelPersistor: last round; IntimeModelSelector: best on validation)
LAST_MODEL, BEST_MODEL = "FL_global_model.pt", "best_FL_global_model.pt"
