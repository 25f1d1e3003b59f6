"""Integrations with the libraries people reach attention through: PyTorch's SDPA
(`flash_cute.integrations.sdpa`) and Hugging Face transformers
(`flash_cute.integrations.transformers`). Each is opt-in: importing flash_cute changes
nothing in those libraries until its `register()` is called."""
