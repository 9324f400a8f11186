"""Worker processes: model backends and the inference loop."""
