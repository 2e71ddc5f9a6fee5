"""``benchmarks/cpu_peers.py``'s fast parts: the checkpoint export (checked against ``transformers``), the GGUF
conversion of a tiny model, the sdist unpacking, output parsing and the report's tables. Building llama.cpp and
timing anything stays in the benchmark itself."""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path

import pytest
import torch

from benchmarks import cpu_peers
from rnnserve.engine.loader import build_random, load_model
from rnnserve.engine.models.base import PrefillBatch
from rnnserve.engine.state_pool import StatePool
from rnnserve.engine.tokenizer import TokenIdTokenizer

LLAMA_SOURCE = cpu_peers.DEFAULT_CACHE / f"llama.cpp-{cpu_peers.LLAMA_CPP_PYTHON_VERSION}"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> cpu_peers.ExportedModel:
    return cpu_peers.export_checkpoints("mamba-tiny", 3, tmp_path_factory.mktemp("export"))


def test_export_writes_the_seeded_weights_for_rnnserve_with_token_id_prompts(exported: cpu_peers.ExportedModel):
    reference, _ = build_random("mamba-tiny", torch.device("cpu"), torch.float32, seed=3)
    model, tokenizer = load_model(str(exported.rnnserve_dir), device="cpu", dtype="float32")
    assert isinstance(tokenizer, TokenIdTokenizer) and tokenizer.vocab_size == exported.vocab_size == 320
    loaded = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    assert exported.parameters == sum(p.numel() for p in reference.parameters())


@torch.inference_mode()
def test_export_is_a_mamba_for_causal_lm_that_transformers_runs_identically(exported: cpu_peers.ExportedModel):
    transformers = pytest.importorskip("transformers")
    reference = transformers.MambaForCausalLM.from_pretrained(exported.hf_dir).eval()
    model, _ = load_model(str(exported.rnnserve_dir), device="cpu", dtype="float32")
    prompt = [5, 17, 300, 2, 99, 41, 7]
    pool = StatePool(model.state_spec(), 2)
    ours = model.prefill(PrefillBatch.build([prompt], [1]), pool.tensors)[0]
    theirs = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_mamba2_export_is_a_mamba2_for_causal_lm_that_transformers_runs_identically(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    exported = cpu_peers.export_checkpoints("mamba2-tiny", 1, tmp_path)
    reference = transformers.Mamba2ForCausalLM.from_pretrained(exported.hf_dir).eval()
    model, tokenizer = load_model(str(exported.rnnserve_dir), device="cpu", dtype="float32")
    assert isinstance(tokenizer, TokenIdTokenizer)
    prompt = [5, 17, 300, 2, 99, 41, 7, 8, 250]
    pool = StatePool(model.state_spec(), 2)
    ours = model.prefill(PrefillBatch.build([prompt], [1]), pool.tensors)[0]
    theirs = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_only_mamba_and_mamba2_are_exported(tmp_path: Path):
    with pytest.raises(ValueError, match="only Mamba and Mamba-2"):
        cpu_peers.export_checkpoints("mingru-tiny", 0, tmp_path)


def test_vllm_is_skipped_with_the_reason_when_no_interpreter_has_it(tmp_path: Path):
    args = cpu_peers.parse_args(["--cache-dir", str(tmp_path)])
    section = cpu_peers.vllm_section(args, None, list(cpu_peers.PAIRS.values()), tmp_path)
    assert "skipped" in section and "CUDA builds" in section and "--install-vllm" in section
    assert not (tmp_path / "models").exists()


def test_hf_config_refuses_what_mamba_for_causal_lm_cannot_express():
    falcon, _ = build_random("mamba-tiny", torch.device("cpu"), torch.float32)
    falcon.config.bcdt_rms_norm = True
    with pytest.raises(ValueError, match="FalconMamba"):
        cpu_peers.hf_mamba_config(falcon.config)
    odd = type(falcon.config)(d_model=64, d_inner=96)
    with pytest.raises(ValueError, match="multiple"):
        cpu_peers.hf_mamba_config(odd)


@pytest.mark.skipif(
    not (LLAMA_SOURCE / "convert_hf_to_gguf.py").exists(),
    reason=f"llama.cpp sources not cached in {LLAMA_SOURCE} (benchmarks/cpu_peers.py fetches them)",
)
def test_gguf_conversion_carries_the_same_weights(
    exported: cpu_peers.ExportedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    pytest.importorskip("transformers")  # the converter imports it
    gguf_path = cpu_peers.convert_hf_to_gguf(LLAMA_SOURCE, exported.hf_dir, tmp_path / "tiny.gguf", "f32")
    monkeypatch.syspath_prepend(str(LLAMA_SOURCE / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.get_field("general.architecture")
    assert bytes(arch.parts[arch.data[0]]).decode() == "mamba"
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    model, _ = load_model(str(exported.rnnserve_dir), device="cpu", dtype="float32")
    mixer = model.backbone.layers[1].mixer
    assert torch.equal(tensors["token_embd.weight"], model.backbone.embeddings.weight)
    assert "output.weight" not in tensors  # tied: llama.cpp reuses the embedding
    assert torch.equal(tensors["blk.1.ssm_in.weight"], mixer.in_proj.weight)
    assert torch.equal(tensors["blk.1.ssm_out.weight"], mixer.out_proj.weight)
    torch.testing.assert_close(tensors["blk.1.ssm_a"], -torch.exp(mixer.A_log), atol=0, rtol=1e-6)
    assert len([name for name in tensors if name.startswith("blk.")]) == 2 * 10


def _sdist(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_takes_the_vendored_llama_cpp_and_the_changelog(tmp_path: Path):
    sdist = _sdist(
        tmp_path / "p.tar.gz",
        {
            "llama_cpp_python-9.9/pyproject.toml": "[project]",
            "llama_cpp_python-9.9/CHANGELOG.md": "## [9.9]\n\n- update llama.cpp to ggml-org/llama.cpp@abcdef123\n",
            "llama_cpp_python-9.9/vendor/llama.cpp/CMakeLists.txt": "project(llama)",
            "llama_cpp_python-9.9/vendor/llama.cpp/tools/server/server.cpp": "int main() {}",
        },
    )
    dest = tmp_path / "llama.cpp-9.9"
    cpu_peers.extract_vendored_llama_cpp(sdist, dest)
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert files == sorted([cpu_peers.CHANGELOG_NAME, "CMakeLists.txt", "tools/server/server.cpp"])
    assert cpu_peers.llama_cpp_commit((dest / cpu_peers.CHANGELOG_NAME).read_text(), "9.9") == "abcdef123"


def test_extract_refuses_an_sdist_without_llama_cpp(tmp_path: Path):
    sdist = _sdist(tmp_path / "p.tar.gz", {"pkg-1.0/setup.py": ""})
    with pytest.raises(RuntimeError, match="no vendor/llama.cpp"):
        cpu_peers.extract_vendored_llama_cpp(sdist, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_commit_is_read_from_the_release_section_only():
    changelog = (
        "## [Unreleased]\n\n## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n\n"
        "## [0.3.35]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n\n## [0.3.34]\n\n- fix: docs\n"
    )
    assert cpu_peers.llama_cpp_commit(changelog, "0.3.36") == "0c1e57098"
    assert cpu_peers.llama_cpp_commit(changelog, "0.3.35") == "4df29be4f"
    assert cpu_peers.llama_cpp_commit(changelog, "0.3.34") == "unknown"
    assert cpu_peers.llama_cpp_commit(changelog, "0.1.0") == "unknown"


def test_batched_bench_rates_are_read_from_its_jsonl_lines():
    rows = [{"pp": 64, "tg": 64, "pl": pl, "speed_tg": rate, "speed_pp": 1.0} for pl, rate in ((1, 88.5), (8, 210.25))]
    output = "\n".join(["llama_model_loader: loaded meta data", *map(json.dumps, rows), "main: done", ""])
    assert cpu_peers.parse_batched_bench(output) == {1: 88.5, 8: 210.25}
    assert cpu_peers.parse_batched_bench("no rows here") == {}


def test_markdown_table_right_aligns_numeric_columns():
    table = cpu_peers.markdown_table(
        ["pair", "batch", "tok/s", "ratio"],
        [["fp32 vs f32", "1", "31.5 / 30.0", "0.44x"], ["bf16 vs f16", "32", "1,248.0 / 1,200.0", "n/a"]],
    )
    assert table.splitlines() == [
        "| pair | batch | tok/s | ratio |",
        "|---|---:|---:|---:|",
        "| fp32 vs f32 | 1 | 31.5 / 30.0 | 0.44x |",
        "| bf16 vs f16 | 32 | 1,248.0 / 1,200.0 | n/a |",
    ]
    assert cpu_peers.markdown_table(["of roofline", "note"], [["64%", "a"], ["n/a", "1 x"]]).splitlines()[1] == (
        "|---:|---|"
    )


def test_best_median_and_ratio():
    assert cpu_peers.best_and_median([3.0, 1.0, 2.0, 10.0]) == (10.0, 2.5)
    assert cpu_peers.ratio(30.0, 60.0) == 0.5
    assert cpu_peers.ratio(30.0, 0.0) is None and cpu_peers.ratio(None, 1.0) is None
    assert cpu_peers.fmt_ratio(0.4444) == "0.44x" and cpu_peers.fmt(1234.56) == "1,234.6"


def test_greedy_agreement_allows_llama_cpp_to_stop_at_its_end_of_text_token():
    assert cpu_peers.greedy_agree([1, 2, 3], [1, 2, 3], stopped_at_eos=False)
    assert not cpu_peers.greedy_agree([1, 2, 3], [1, 2, 4], stopped_at_eos=False)
    assert cpu_peers.greedy_agree([1, 2, 0, 5], [1, 2], stopped_at_eos=True)
    assert not cpu_peers.greedy_agree([1, 3, 0, 5], [1, 2], stopped_at_eos=True)


def test_machine_summary_names_the_simd_that_matters():
    lscpu = "Architecture: x86_64\nCPU(s): 2\nModel name: AMD EPYC\nFlags: fpu sse avx avx2 fma f16c bmi2\n"
    summary = cpu_peers.machine_summary(lscpu, "MemTotal:       24576000 kB\n")
    assert summary == "AMD EPYC, 2 CPUs, avx2 fma f16c (no AVX-512), 23.4 GiB"


def test_arguments_default_to_the_issue_s_run_and_reject_nonsense():
    args = cpu_peers.parse_args([])
    assert (args.batches, args.reps, args.streams) == ([1, 8, 32], 4, [1, 32])
    assert args.dtypes == ["fp32", "bf16", "int8", "int4"]
    assert not args.no_http and args.out is None
    assert cpu_peers.parse_args(["--dtypes", "bf16", "--batches", "1", "--out", "r.md"]).out == Path("r.md")
    for bad in (["--reps", "0"], ["--batches", "-1"], ["--dtypes", "fp16"]):
        with pytest.raises(SystemExit):
            cpu_peers.parse_args(bad)


def test_engine_rates_time_full_decode_batches_and_leave_the_engine_empty(exported: cpu_peers.ExportedModel):
    engine = cpu_peers.make_engine(exported.rnnserve_dir, cpu_peers.PAIRS["fp32"], max_num_seqs=4)
    rate = cpu_peers.engine_decode_rate(engine, batch=3, prompt_len=5, steps=4)
    assert math.isfinite(rate) and rate > 0
    assert not engine.has_unfinished_requests() and engine.pool.num_free == 4
    prompts = cpu_peers.token_prompts(6, 5, exported.vocab_size, seed=1)
    for concurrency in (1, 4):
        assert cpu_peers.engine_served_rate(engine, prompts, new_tokens=3, concurrency=concurrency) > 0
        assert not engine.has_unfinished_requests()
    first, again = (cpu_peers.greedy_tokens(engine, prompts[:2], 6) for _ in range(2))
    assert first == again and all(len(tokens) == 6 for tokens in first)


def test_step_bytes_count_a_tied_head_once_and_skip_an_embedding_only_looked_up(exported: cpu_peers.ExportedModel):
    model = cpu_peers.make_engine(exported.rnnserve_dir, cpu_peers.PAIRS["fp32"], max_num_seqs=2).model
    assert model.lm_head.weight is model.backbone.embeddings.weight
    assert cpu_peers.step_bytes(model) == 4 * exported.parameters
    int8 = cpu_peers.make_engine(exported.rnnserve_dir, cpu_peers.PAIRS["int8"], max_num_seqs=2).model
    tensors = {t.data_ptr(): t for t in (*int8.parameters(), *int8.buffers())}
    embedding = int8.backbone.embeddings.weight
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert cpu_peers.step_bytes(int8) == total - embedding.numel() * embedding.element_size()
