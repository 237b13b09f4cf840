"""Run vLLM 0.33.0's own e2e test files through the plugin.

``python -m tests.vllm_upstream.harness`` (``make test-vllm-upstream``):

1. downloads vLLM 0.33.0's source distribution from the package index with
   pip (cached under ``~/.cache/vllm-hpu-mm``) and checks its sha256;
2. extracts its ``tests/`` folder into a temporary directory (never into the
   repository);
3. in the selected files only, replaces the hub model names by the tiny local
   models and shrinks sizes (``SUBSTITUTIONS``), nothing else;
4. runs pytest on them, vLLM's ``tests`` package first on the path, with the
   cases whose expectations belong to the hub model they were written for
   deselected (``DESELECT``, each with its reason).

It is a separate target, not part of ``make test``: it needs the package index
at test time and several engine starts (10 min on a shared 2-core machine:
92 cases, 71 pass, 21 deselected below with their reasons).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.33.0"
SDIST = f"vllm-{VERSION}.tar.gz"
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-hpu-mm"

# What vLLM's tests/conftest.py imports beyond the plugin's own requirements;
# installed by pip into the cache (never into the venv), on the path of the run.
TEST_DEPS = ("tblib==3.2.2", "pytest-asyncio==1.5.0")

TINY_LLAMA = str(REPO_ROOT / "models" / "tiny-llama")

# file in the sdist's tests/ -> [(text, replacement)]: hub model names become
# the tiny local model, and engine sizes shrink (a 2-core CPU); nothing else,
# except test_chat.py's LoRA adapter (see DESELECT_EXPR).
SMALL_LLM = "LLM(MODEL, enforce_eager=True, max_model_len=512, max_num_seqs=8)"
SUBSTITUTIONS: dict[str, list[tuple[str, str]]] = {
    "v1/sample/test_sampling_params_e2e.py": [
        ("hmellor/tiny-random-LlamaForCausalLM", TINY_LLAMA),
        ("LLM(MODEL, enforce_eager=True)", SMALL_LLM),
    ],
    "samplers/test_no_bad_words.py": [
        ("hmellor/tiny-random-LlamaForCausalLM", TINY_LLAMA),
        ("distilbert/distilgpt2", TINY_LLAMA),
    ],
    "samplers/test_ignore_eos.py": [
        ('["distilbert/distilgpt2", "meta-llama/Llama-3.2-1B"]', f'["{TINY_LLAMA}"]'),
    ],
    "samplers/test_logprobs.py": [("distilbert/distilgpt2", TINY_LLAMA)],
    "entrypoints/llm/test_generate.py": [
        ("distilbert/distilgpt2", TINY_LLAMA),
        # its longest prompt is 21 tokens for the tiny tokenizer, 20 or fewer
        # for distilgpt2's
        ("max_model_len = 20", "max_model_len = 32"),
    ],
    "entrypoints/openai/completion/test_completion.py": [
        ('"Qwen/Qwen3-0.6B"', f'"{TINY_LLAMA}"'),
        ('"--max-num-seqs",\n        "128"', '"--max-num-seqs",\n        "8"'),
    ],
    "entrypoints/openai/chat_completion/test_chat.py": [
        ('"HuggingFaceH4/zephyr-7b-beta"', f'"{TINY_LLAMA}"'),
        ('"--max-model-len",\n        "8192"', '"--max-model-len",\n        "2048"'),
        ('"--max-num-seqs",\n        "128"', '"--max-num-seqs",\n        "8"'),
        # The LoRA adapter is a hub download made for zephyr-7b (its shapes
        # are zephyr-7b's, not the tiny Llama's): the server runs without it,
        # and the cases that address it are deselected.
        (
            'return hf_api().snapshot_download(repo_id="typeof/zephyr-7b-beta-lora")',
            "return None",
        ),
        (
            """        # lora config below
        "--enable-lora",
        "--lora-modules",
        f"zephyr-lora={zephyr_lora_files}",
        "--max-lora-rank",
        "64",
        "--max-cpu-loras",
        "2",
""",
            "",
        ),
    ],
}
# Not run: v1/sample/test_logprobs_e2e.py (a GSM8K accuracy run with lm_eval
# on Llama-3.2-1B: an expectation of the hub model by construction).

COMPLETION = "entrypoints/openai/completion/test_completion.py"
CHAT = "entrypoints/openai/chat_completion/test_chat.py"

# "file::case" -> why it is specific to the hub model
DESELECT: dict[str, str] = {
    "v1/sample/test_sampling_params_e2e.py::test_stop": (
        "takes the 6th whitespace-separated word of the hub model's greedy text "
        "as a stop string; the tiny model's text has fewer words (IndexError) "
        "(stop strings: tests/e2e/test_llm_generate.py; stop token ids: "
        "test_stop_token_ids here)"
    ),
    "v1/sample/test_sampling_params_e2e.py::test_allowed_token_ids": (
        "forces token ids up to 31999, the hub model's 32000-token vocabulary; "
        "the tiny Llama has 640, so vLLM rejects them as out of vocabulary "
        "(allowed_token_ids: tests/e2e/test_logits_processors.py)"
    ),
    "samplers/test_no_bad_words.py::TestOneTokenBadWord::test_one_token_bad_word": (
        "asserts that the hub model's greedy answer to 'How old are ' starts "
        "with the token 'mn' (bad_words: tests/e2e/test_logits_processors.py)"
    ),
    "samplers/test_no_bad_words.py::TestTwoTokenBadWord::test_two_token_bad_word": (
        "asserts that distilgpt2's greedy answer continues 'years old' "
        "(bad_words: tests/e2e/test_logits_processors.py)"
    ),
    f"{COMPLETION}::test_single_completion[{TINY_LLAMA}]": (
        "expects 5 prompt tokens for 'Hello, my name is', Qwen3's tokenization "
        "(the tiny tokenizer makes 11)"
    ),
    f"{COMPLETION}::test_logprob_token_ids": (
        "asks for token id 5000; the tiny vocabulary has 640 (vLLM answers 400)"
    ),
    f"{COMPLETION}::test_logprob_token_ids_stream": (
        "asks for token id 5000; the tiny vocabulary has 640 (vLLM answers 400)"
    ),
    f"{CHAT}::test_more_than_one_prompt_logprobs_chat[{TINY_LLAMA}]": (
        "expects zephyr's prompt token at position 3 to be its own top-1, so that "
        "prompt_logprobs=1 gives one entry; vLLM gives the prompt token plus the "
        "top-k, two entries when they differ, as here (rank 163) "
        "(prompt logprobs vs HF: tests/e2e/test_prompt_logprobs.py)"
    ),
    f"{CHAT}::test_single_chat_session[{TINY_LLAMA}]": (
        "compares usage with zephyr's chat-template token count"
    ),
    f"{CHAT}::test_structured_outputs_json_chat": (
        "a trained model closes its JSON strings within 1000 tokens; the random "
        "one does not (schema checks: tests/e2e/test_structured_output.py)"
    ),
    f"{CHAT}::test_response_format_json_object": (
        "expects the answer to '1+1' ({'result': 2})"
    ),
    f"{CHAT}::test_response_format_json_schema": (
        "expects the answer to '1+1' ({'result': 2})"
    ),
    f"{CHAT}::test_complex_message_content": ("expects the answer '2' to a sum"),
}
# pytest -k expressions -> why
DESELECT_EXPR: dict[str, str] = {
    "zephyr-lora": "test_chat.py's LoRA adapter for zephyr-7b (a hub download; "
    "shaped for zephyr-7b, not the tiny Llama; LoRA itself: tests/e2e/test_lora.py)",
}


def fetch_sdist(cache: Path = CACHE) -> Path:
    """The sdist, downloaded with pip on first use, checked against the pin."""
    path = cache / SDIST
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # vLLM's setup.py derives its version from the target device (it
        # would call itself 0.33.0+cpu here and pip would refuse it).
        env = {**os.environ, "VLLM_TARGET_DEVICE": "empty"}
        env["VLLM_VERSION_OVERRIDE"] = VERSION
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                f"vllm=={VERSION}",
                "-d",
                str(cache),
            ],
            check=True,
            env=env,
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(
            f"{path}: sha256 {digest}, expected {SDIST_SHA256} (pinned); "
            "delete it to download again"
        )
    return path


def test_deps(cache: Path = CACHE) -> Path:
    """A folder holding ``TEST_DEPS`` (pip install --target, once)."""
    target = cache / ("deps-" + "-".join(TEST_DEPS).replace("==", "_"))
    if not target.exists():
        tmp = target.with_suffix(".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--target",
                str(tmp),
                *TEST_DEPS,
            ],
            check=True,
        )
        tmp.rename(target)
    return target


def extract(sdist: Path, dest: Path) -> Path:
    """Extract the sdist's tests/ under ``dest``; returns the root holding it."""
    prefix = f"vllm-{VERSION}/tests/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(dest, members=members, filter="data")
    root = dest / f"vllm-{VERSION}"
    for rel, subs in SUBSTITUTIONS.items():
        path = root / "tests" / rel
        text = path.read_text()
        for old, new in subs:
            if old not in text:
                raise RuntimeError(f"{rel}: {old!r} not found (the file changed?)")
            text = text.replace(old, new)
        path.write_text(text)
    return root


def run(root: Path, pytest_args: list[str], deps: Path) -> int:
    files = [f"tests/{rel}" for rel in SUBSTITUTIONS]
    deselect = [arg for case in DESELECT for arg in ("--deselect", f"tests/{case}")]
    if DESELECT_EXPR:
        deselect += ["-k", " and ".join(f"not {e}" for e in DESELECT_EXPR)]
    env = {**os.environ}
    # vLLM's RemoteOpenAIServer starts the `vllm` command of this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    # vLLM's tests package first; the plugin from this checkout.
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO_ROOT), str(deps)])
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        *files,
        *deselect,
        *pytest_args,
    ]
    return subprocess.run(cmd, cwd=root, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="extract here and keep it")
    parser.add_argument("--list", action="store_true", help="list deselected cases")
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest")
    args = parser.parse_args(argv)
    if args.list:
        for case, why in {**DESELECT, **DESELECT_EXPR}.items():
            print(f"{case}: {why}")
        return 0
    sdist, deps = fetch_sdist(), test_deps()
    if args.keep:
        return run(extract(sdist, args.keep), args.pytest_args, deps)
    with tempfile.TemporaryDirectory(prefix="vllm_upstream_") as tmp:
        code = run(extract(sdist, Path(tmp)), args.pytest_args, deps)
        shutil.rmtree(tmp, ignore_errors=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
