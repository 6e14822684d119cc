"""Whole models: `apply_checkpointing` / `plan_model` on ResNet50, a U-Net, MobileNetV2
and GPT2Backbone (`run.py`, each strategy's peak read in a fresh process by
`peaks.py`, reported by `report.py`), its follow-up checks (`followup.py`) and a sweep
over other `keras.applications` models (`applications_sweep.py`)."""
