"""What the commands share above the features: opening a checkpoint (`checkpoints`), a
command's evaluation job and a sweep's hand-over (`jobs`), calibrating on a checkpoint
(`calibration`), generation's codecs and prompts (`prompts`), and lm-evaluation-harness's
`--model recdepth` (`lm_eval`). These modules read configs and files and drive the features;
the features (model, exits, decode, data, training, analysis) never import them
(tests/test_layers.py: the folders' order).
"""
