"""The public functions and the torch.library operators, on top of the runtime."""
