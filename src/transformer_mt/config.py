"""Where the Hydra configs live: transformer_mt/conf, a link to the checkout's conf/ (a copy once installed)."""

from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parent / "conf")
