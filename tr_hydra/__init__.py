"""tr_hydra: a Hydra-driven trainer that plans every byte of device memory before the first step."""
__version__ = "0.1.0"
