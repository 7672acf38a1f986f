"""Start-up checks of the connector's settings that need no engine."""

from clients.vllm.settings import vllm_version_note


def test_supported_vllm_releases_pass_and_others_get_one_clear_line():
    assert vllm_version_note("0.32.0") is None
    assert vllm_version_note("0.33.1") is None
    note = vllm_version_note("0.34.0")
    assert note is not None and "0.34.0" in note and "0.32 on CPU, 0.33 on GPU" in note
    assert vllm_version_note("unknown") is not None
