from tr_hydra.config.schema import Config, register_configs

register_configs()

__all__ = ["Config", "register_configs"]
