"""The offline API (LLM.generate/chat) and `ember generate`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ember import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_generate_returns_outputs_in_input_order(tiny_llm, tiny_reference):
    tokenizer = tiny_llm.get_tokenizer()
    texts = ["The quick brown fox jumps over the lazy dog, again and again.", "Hi", "Numbers: 1 2 3 4 5"]
    outputs = tiny_llm.generate(texts, GREEDY, use_tqdm=True)
    assert [out.prompt for out in outputs] == texts
    for text, out in zip(texts, outputs, strict=True):
        assert out.prompt_token_ids == tokenizer.encode(text)
        assert out.outputs[0].token_ids == tiny_reference(out.prompt_token_ids, 6)
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids)
        assert out.finished and out.metrics.first_token_time >= out.metrics.arrival_time
    single = tiny_llm.generate("Hi", GREEDY)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    by_ids = tiny_llm.generate([outputs[1].prompt_token_ids], GREEDY)[0]
    assert by_ids.prompt is None and by_ids.outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_generate_with_one_params_per_prompt(tiny_llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 4, 2)]
    outputs = tiny_llm.generate([[5, 6], [7, 8], [9, 10]], params)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [1, 4, 2]
    with pytest.raises(ValueError, match="3 sampling_params for 2 prompts"):
        tiny_llm.generate([[1], [2]], params)


def test_chat_applies_the_chat_template(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    conversation = [{"role": "user", "content": "What is 2+2?"}]
    expected_prompt = tokenizer.encode(tokenizer.apply_chat_template(conversation), add_special_tokens=False)
    outputs = tiny_llm.chat(conversation, GREEDY)
    assert outputs[0].prompt_token_ids == expected_prompt
    assert tokenizer.decode(expected_prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    two = tiny_llm.chat([conversation, [{"role": "user", "content": "Hello"}]], GREEDY)
    assert len(two) == 2 and two[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_importing_ember_does_not_import_torch():
    code = "import sys, ember; assert 'torch' not in sys.modules; ember.SamplingParams; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.stdout.strip() == "ok", result.stderr


def test_ember_generate_prints_the_completion(tiny_model_dir, tiny_llm, capsys):
    from ember.cli import main

    code = main(["generate", "--model", str(tiny_model_dir), "--dtype", "float32", "--num-threads", "1",
                 "--prompt", "Hello there", "--max-tokens", "5", "--ignore-eos"])
    assert code == 0
    expected = tiny_llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    printed = capsys.readouterr().out
    assert printed == expected[0].outputs[0].text + "\n" and printed.strip()


def test_ember_generate_bad_sampling_value_is_one_error_line(tiny_model_dir, capsys):
    from ember.cli import main

    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--top-p", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == ["ember generate: error: top_p must be in (0, 1], got 0.0"]


def test_ember_generate_missing_model_exits_2_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ember.cli", "generate", "--model", str(tmp_path / "nope.gguf"),
                             "--prompt", "x"], capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember generate: error:") and "nope.gguf" in lines[0]
    assert result.stdout == ""
