"""Hydra search-path plugin: puts the adapter's configs (`arctic_rl_verl/conf`) on verl's
config search path, so `model_engine=arctic_rl` and `--config-name arctic_ppo_trainer` resolve."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class ArcticRLSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="arctic-rl", path="pkg://arctic_rl_verl.conf")
