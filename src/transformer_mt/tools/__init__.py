"""Looking at and shipping a model: export (+ model_card), attention_maps, plot, table3."""
