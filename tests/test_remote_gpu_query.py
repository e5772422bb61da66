"""The remote's GPUs read from nvidia-smi and rocm-smi output as those tools print it on real machines (the memory
planner checks the config against the first one)."""
import pytest

from modules.remote.gpu_query import NVIDIA_SMI, ROCM_SMI, parse_nvidia_smi, parse_rocm_smi, query_gpus

GIB = 2 ** 30

# ROCm 6: a warning on stdout before the JSON, the product under "Card Series", the memory as strings of bytes
ROCM_6_TWO_CARDS = """WARNING: AMD GPU device(s) is/are in a low-power state. Check power control/runtime_status

{"card0": {"VRAM Total Memory (B)": "206158430208", "VRAM Total Used Memory (B)": "293601280", "Card Series": \
"AMD Instinct MI300X", "Card Model": "0x74a1", "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]", \
"Card SKU": "M3000100", "Subsystem ID": "0x74a1", "Device Rev": "0x00", "Node ID": "2", "GUID": "28851", \
"GFX Version": "gfx942"}, "card1": {"VRAM Total Memory (B)": "206158430208", "VRAM Total Used Memory (B)": \
"103079215104", "Card Series": "AMD Instinct MI300X", "Card Model": "0x74a1", "Card Vendor": "Advanced Micro \
Devices, Inc. [AMD/ATI]", "Card SKU": "M3000100", "Subsystem ID": "0x74a1", "Device Rev": "0x00", "Node ID": "3", \
"GUID": "43178", "GFX Version": "gfx942"}}
"""

# ROCm 4: "Card series" in lower case, a PCI id where the name should be, a "system" entry beside the cards,
# indented as rocm-smi's json.dumps writes it
ROCM_4_SYSTEM_ENTRY = """{
  "system": {
    "Driver version": "5.11.32"
  },
  "card0": {
    "VRAM Total Memory (B)": "34342961152",
    "VRAM Total Used Memory (B)": "7340032",
    "Card series": "0x738c",
    "Card model": "0xc34",
    "Card vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
    "Card SKU": "D34314"
  }
}
"""

# a card whose memory rocm-smi cannot read, beside a consumer card
ROCM_NA_CARD = """{"card0": {"VRAM Total Memory (B)": "N/A", "VRAM Total Used Memory (B)": "N/A", \
"Card Series": "Raphael"}, "card1": {"VRAM Total Memory (B)": "21458059264", "VRAM Total Used Memory (B)": \
"27856896", "Card Series": "Radeon RX 7900 XT", "Card Model": "0x744c"}}"""


def test_rocm_smi_with_a_warning_before_its_json_gives_each_card_by_its_product_name():
    gpus = parse_rocm_smi(ROCM_6_TWO_CARDS)
    assert [name for name, _, _ in gpus] == ["AMD Instinct MI300X", "AMD Instinct MI300X"]
    assert gpus[0][2] == pytest.approx(206158430208 / GIB)   # 192 GiB
    assert gpus[0][1] == pytest.approx((206158430208 - 293601280) / GIB)
    assert gpus[1][1] == pytest.approx(96.0)   # the second card half used: its free memory, not its total


def test_old_rocm_smi_key_names_and_its_system_entry():
    assert parse_rocm_smi(ROCM_4_SYSTEM_ENTRY) == [
        ("0x738c", pytest.approx((34342961152 - 7340032) / GIB), pytest.approx(34342961152 / GIB))]


def test_a_card_without_a_memory_reading_is_left_out_and_no_json_is_no_gpu():
    assert [name for name, _, _ in parse_rocm_smi(ROCM_NA_CARD)] == ["Radeon RX 7900 XT"]
    assert parse_rocm_smi("WARNING: No JSON data to report\n") == []
    assert parse_rocm_smi("") == []


def test_nvidia_smi_lines_and_one_without_a_memory_reading():
    text = "NVIDIA H100 80GB HBM3, 80513, 81559\nNVIDIA A100-SXM4-40GB, [N/A], [N/A]\n"
    assert parse_nvidia_smi(text) == [("NVIDIA H100 80GB HBM3", pytest.approx(80513 / 1024),
                                       pytest.approx(81559 / 1024))]


class _Answers:
    """A remote that answers commands from a table (what its shell would print), for the choice of tool."""

    def __init__(self, answers: dict[str, tuple[int, str, str]]):
        self.answers, self.asked = answers, []

    def run(self, command, check=True):
        self.asked.append(command)
        return self.answers.get(command, (127, "", "sh: 1: not found"))


def test_without_nvidia_smi_the_gpus_are_read_from_rocm_smi():
    remote = _Answers({ROCM_SMI: (0, ROCM_6_TWO_CARDS, "")})
    assert [name for name, _, _ in query_gpus(remote)] == ["AMD Instinct MI300X"] * 2
    assert remote.asked == [NVIDIA_SMI, ROCM_SMI]
    assert query_gpus(_Answers({})) == []
