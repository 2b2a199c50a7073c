"""Looking at and shipping a model: export.py (with model_card.py), attention_maps.py, plot.py, table3.py."""
