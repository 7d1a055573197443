"""Configuration: the run's typed dataclasses (`run.py`) and their flags (`run_flags.py`), where flag values
come from — flags, `DILOCOX_*` environment, `--config` file — (`sources.py`), and `dilocox config show`
(`show.py`)."""
