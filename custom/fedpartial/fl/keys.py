"""Names of the metadata that travels between sites and server (one name per concept)."""

META_SUMMARY = "fedpartial_data_summary"  # server -> sites: every site's annotated counts
META_N_TRAIN = "n_train"  # site -> server: training-set size (FedAvg weight)
META_ANNOTATED = "annotated"  # site -> server: (C,) bool classes annotated at the site
META_GROUPS = "param_groups"  # site -> server: state-dict keys by group (encoder / norm / head / classifier)
META_WEIGHT = "participation"  # site -> server: participation weight of the round's update (0 = sat it out)
META_SPEC = "fedpartial_job_spec"  # server -> sites (data check): method, resolved options, model architecture
META_RULE_ERROR = "fedpartial_rule_error"  # server -> results: the rule failed this round (previous model kept)
META_SKIPPED = "fedpartial_sat_out"  # server -> results: sites whose update had participation weight 0
META_MISSING = "fedpartial_missing"  # server -> results: sites that sent no update this round (dead, slow, failed)
META_REJECTED = "fedpartial_rejected"  # server -> results: {site: why} updates refused this round
META_CLIPPED = "fedpartial_clipped"  # server -> results: sites whose too-large changes were clipped this round
META_RESULTS = "fedpartial_results"  # site -> server: full metric dicts of the received model
META_PRIVACY = (
    "fedpartial_privacy"  # site -> server: the round's privacy ledger entry (what per-class statistics left, how)
)
META_TEST = "test_metrics"  # site -> server: flat test metrics of the received model
STATE_FILE = "trainer_state.pt"
LOCAL_MODEL_FILE = "last_local_model.pt"  # a site's model after its last round (its local parts: its own)
STATE_DIR = "fedpartial_state"  # both, in the site's run folder: <site workspace>/<job id>/fedpartial_state
# the server's global model files (PTFileModelPersistor: last round; IntimeModelSelector: best on validation)
LAST_MODEL, BEST_MODEL = "FL_global_model.pt", "best_FL_global_model.pt"
