"""``python -m transnormer.presets`` prints every preset with its parameter count."""

from .models.presets import PRESETS, build_model, count_parameters, get_config, preset_table, register_preset

__all__ = ["PRESETS", "build_model", "count_parameters", "get_config", "preset_table", "register_preset"]

if __name__ == "__main__":
    print(preset_table())
