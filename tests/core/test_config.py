import pytest
from click.testing import CliRunner

from pagellm.cli.options import config_from_options
from pagellm.core.config import EngineConfig, step_tokens
from pagellm.core.errors import ConfigError


def test_unknown_setting_lists_valid_names():
    with pytest.raises(ConfigError, match="unknown engine setting.*blok_size.*valid:.*block_size"):
        EngineConfig.from_kwargs(blok_size=16)


def test_images_per_prompt_default_to_vllms_999():
    assert EngineConfig().image_limit == 999
    assert EngineConfig(limit_mm_per_prompt="{}").image_limit == 999
    assert EngineConfig(limit_mm_per_prompt='{"image": 2}').image_limit == 2


def test_cli_options_map_to_config_fields():
    import click

    from pagellm.cli.options import engine_options

    seen = {}

    @click.command()
    @engine_options()
    def cmd(**options):
        seen["config"] = config_from_options(options)

    result = CliRunner().invoke(
        cmd,
        ["--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-space", "1.5", "--dtype", "float32"],
    )
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.block_size, config.enable_prefix_caching, config.kv_cache_space, config.dtype) == (
        32,
        False,
        1.5,
        "float32",
    )
    assert config.enable_chunked_prefill is True  # untouched options keep the dataclass default


def test_device_and_backend_read_their_environment_variables(monkeypatch):
    import click

    from pagellm.cli.options import engine_options

    seen = {}

    @click.command()
    @engine_options()
    def cmd(**options):
        seen["config"] = config_from_options(options)

    monkeypatch.setenv("PAGELLM_DEVICE", "cpu")
    monkeypatch.setenv("PAGELLM_ATTENTION_BACKEND", "TORCH_SDPA")
    assert CliRunner().invoke(cmd, []).exit_code == 0
    assert (seen["config"].device, seen["config"].attention_backend) == ("cpu", "TORCH_SDPA")


@pytest.mark.parametrize(("chunked", "expected"), [(True, 512), (False, 4096)])
def test_the_step_token_rule_is_the_configs(chunked, expected):
    """One rule for the most tokens a step runs (the scheduler schedules by it, the runner sizes its KV
    cache and memory profile with it): the budget, or a whole prompt without chunked prefill."""
    config = EngineConfig(max_num_batched_tokens=512, enable_chunked_prefill=chunked)
    assert config.step_tokens(4096) == expected
    assert step_tokens(512, chunked, 4096) == expected
    assert EngineConfig(max_num_batched_tokens=8192, enable_chunked_prefill=False).step_tokens(4096) == 8192
