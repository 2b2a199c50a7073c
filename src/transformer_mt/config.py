"""Where the Hydra configs live: `conf/` of a source checkout, or the copy installed with the package."""

from __future__ import annotations

from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[2] / "conf"  # src/transformer_mt/config.py -> conf/
_INSTALLED = Path(__file__).resolve().parent / "conf"  # pip install . puts conf/ inside the package

CONF_DIR = str(_CHECKOUT if (_CHECKOUT / "train.yaml").is_file() else _INSTALLED)
