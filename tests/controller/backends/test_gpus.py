"""The local GPUs' names: what the driver calls a card, as the spec names it (for the memory check)."""

import pytest

from mortal.controller.backends.gpus import GPU_MEMORY, spec_name_of


@pytest.mark.parametrize(
    ("device_name", "spec_name"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla T4", "T4"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_a_card_is_named_as_the_spec_names_it(device_name: str, spec_name: str) -> None:
    assert spec_name_of(device_name) == spec_name
    assert spec_name in GPU_MEMORY


@pytest.mark.parametrize(
    "device_name", ["NVIDIA GeForce RTX 4090", "NVIDIA H100 NVL", "AMD Instinct MI300X", ""]
)
def test_a_card_of_no_listed_size_has_no_name(device_name: str) -> None:
    """Unknown, or a variant whose memory differs from its family's (H100 NVL: 94 GB, not 80)."""
    assert spec_name_of(device_name) is None
