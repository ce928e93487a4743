"""Fixed, offline benchmark workloads: chat prompts of varied length and per-request output lengths.

Everything is built from text written here and the model's own chat template, so every system in a
benchmark run (and every re-run with the same seed) sees exactly the same token ids.
"""

from __future__ import annotations

import random

# Varied on purpose: one-liners, medium questions, and long ones that carry context, so prompt
# lengths spread from ~35 to ~200 tokens after the chat template.
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me three tips for a better night's sleep.",
    "What is the difference between a virus and a bacterium?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is a prime number? Give five examples.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a friendly golden retriever puppy.",
    "What is the boiling point of water at the top of Mount Everest, and why is it different from sea level?",
    "I am planning a three-day trip to Rome with my parents, who do not like walking long distances. "
    "Which sights should we prioritise, and how should we get around the city?",
    "Explain recursion to a ten-year-old.",
    "What are the main causes of inflation?",
    "Write a short, polite email declining a meeting invitation because of a scheduling conflict.",
    "List the planets of the solar system in order from the Sun.",
    "How many minutes are there in a week?",
    "My tomato plants have yellow leaves at the bottom and the fruit is cracking. I water them every "
    "evening and they get about six hours of sun. What could be wrong and what should I change?",
    "What is the Pythagorean theorem?",
    "Describe the water cycle.",
    "Give me a simple recipe for pancakes.",
    "What does HTTP stand for and what is it used for?",
    "Who wrote 'Pride and Prejudice'?",
    "Explain the difference between weather and climate.",
    "I have a job interview for a junior data analyst position next week. The job description "
    "mentions SQL, spreadsheets and communicating results to non-technical managers. How should I "
    "prepare, and what questions might they ask me?",
    "What is machine learning?",
    "Why do cats purr?",
    "Write a limerick about a forgetful robot.",
    "How do vaccines work?",
    "What is the tallest mountain in the world?",
    "Explain what a black hole is.",
    "Compare renting and buying a home. What should a young couple consider before deciding?",
    "How do I make a cup of green tea properly?",
    "What is the difference between 'affect' and 'effect'?",
    "Name three famous paintings by Vincent van Gogh.",
    "Our small team keeps missing deadlines because tasks are assigned in chat messages and then "
    "forgotten. We are five people working remotely across two time zones. Propose a lightweight "
    "process to track work without adding a lot of meetings.",
    "What is the speed of light?",
    "Why do we have leap years?",
    "How does a bicycle stay upright when it moves?",
    "Explain supply and demand with an example.",
    "Write a two-line poem about the sea.",
    "What are the benefits of regular exercise?",
    "How do bees make honey?",
    "What is an API?",
    "Give me a short motivational quote and explain what it means.",
    "A train leaves a station at 3 pm travelling at 80 km/h. Another train leaves the same station "
    "at 4 pm on a parallel track travelling at 120 km/h in the same direction. At what time does the "
    "second train catch up with the first, and how far from the station are they?",
    "What is the largest ocean on Earth?",
    "How do I politely ask my neighbour to turn down loud music?",
    "What is the function of the heart?",
    "Explain the rules of chess in a few sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Why do leaves change colour in the fall?",
    "I want to start learning the guitar as an adult with very little free time, maybe twenty "
    "minutes a day. What should a realistic first three months look like?",
    "What is gravity?",
    "Tell me a fun fact about octopuses.",
    "How does compound interest work?",
    "What should I pack for a weekend camping trip?",
    "Who was Marie Curie?",
    "Describe a sunset to someone who has never seen one.",
    "What is the greenhouse effect?",
    "How can I improve my handwriting?",
]

# GRPO-shaped workload: short maths questions, like a gsm8k rollout batch.
GRPO_QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she "
    "needs. Her parents give her $15, and her grandparents twice as much. How much more money does "
    "Betty need?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
    "Tom has 5 apples. He buys 3 bags with 4 apples each and eats 2. How many apples are left?",
    "A rectangle is 7 cm wide and 3 times as long. What is its perimeter?",
    "A shop sells pens at 3 for $2. How much do 18 pens cost?",
]


def chat_prompt_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    """Token ids of each question wrapped in the tokenizer's chat template (with the assistant turn
    opened), exactly as a chat model is prompted."""
    from nopad.inference.chat import encode_prompt

    return [encode_prompt(tokenizer, q, chat=True) for q in questions]


def chat_workload(tokenizer, num_prompts: int, min_new: int, max_new: int, seed: int):
    """``(prompt_ids, max_new_tokens)`` for ``num_prompts`` chat requests; output lengths drawn
    uniformly from ``[min_new, max_new]`` with ``seed``. Questions are cycled (with a numbered
    suffix so prompts stay distinct) if more prompts than questions are asked for."""
    if num_prompts < 1 or min_new < 1 or max_new < min_new:
        raise ValueError(
            f"need num_prompts >= 1 and 1 <= min_new <= max_new, got {num_prompts}, [{min_new}, {max_new}]"
        )
    questions = []
    for i in range(num_prompts):
        q = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
        rounds = i // len(CHAT_QUESTIONS)
        questions.append(q if rounds == 0 else f"{q} (variant {rounds})")
    rng = random.Random(seed)
    max_new_tokens = [rng.randint(min_new, max_new) for _ in range(num_prompts)]
    return chat_prompt_ids(tokenizer, questions), max_new_tokens


def prefill_workload(
    tokenizer, num_prompts: int, min_prompt: int, max_prompt: int, min_new: int, max_new: int, seed: int
):
    """Prefill-heavy ``(prompt_ids, max_new_tokens)``: "summarise this documentation" chat prompts
    over Python standard-library docstrings (offline, :mod:`nopad.assets.corpus`) whose templated length
    falls in ``[min_prompt, max_prompt]`` tokens, with short outputs drawn from ``[min_new, max_new]``.
    Long inputs and short answers (retrieval, classification, judging) make prefill most of the work."""
    from nopad.assets.corpus import load_corpus

    if num_prompts < 1 or not 1 <= min_prompt <= max_prompt or not 1 <= min_new <= max_new:
        raise ValueError(
            f"need num_prompts >= 1, 1 <= min_prompt <= max_prompt and 1 <= min_new <= "
            f"max_new, got {num_prompts}, [{min_prompt}, {max_prompt}], [{min_new}, {max_new}]"
        )
    rng = random.Random(seed)
    docs = load_corpus(max_documents=None, min_chars=4 * min_prompt)
    rng.shuffle(docs)
    prompts = []
    for doc in docs:
        ids = chat_prompt_ids(tokenizer, [f"Summarise this documentation in one sentence:\n\n{doc}"])[0]
        if min_prompt <= len(ids) <= max_prompt:
            prompts.append(ids)
            if len(prompts) == num_prompts:
                break
    if len(prompts) < num_prompts:
        raise ValueError(f"only {len(prompts)} docstrings give prompts of {min_prompt}-{max_prompt} tokens")
    return prompts, [rng.randint(min_new, max_new) for _ in range(num_prompts)]


def grpo_workload(tokenizer, num_prompts: int) -> list[list[int]]:
    """Prompt ids of the first ``num_prompts`` GRPO maths questions."""
    if not 1 <= num_prompts <= len(GRPO_QUESTIONS):
        raise ValueError(f"num_prompts must be in [1, {len(GRPO_QUESTIONS)}], got {num_prompts}")
    return chat_prompt_ids(tokenizer, GRPO_QUESTIONS[:num_prompts])


def static_batch_occupancy(max_new_tokens: list[int], batch_size: int) -> tuple[list[int], list[int]]:
    """Per decode step of static padded batching (batches of ``batch_size`` in arrival order, each
    running to its longest request): ``(slots_held, slots_useful)``. A request whose tokens are done
    still holds its slot until the whole batch finishes; only unfinished requests are useful."""
    held, useful = [], []
    for start in range(0, len(max_new_tokens), batch_size):
        batch = max_new_tokens[start : start + batch_size]
        for step in range(max(batch)):
            held.append(len(batch))
            useful.append(sum(k > step for k in batch))
    return held, useful


def tiny_llama(vocab_size: int = 256, layers: int = 2, seed: int = 0, tokenizer=None):
    """A random-weight Llama (hidden 64, 4 heads, 2 KV heads) for ``--quick`` runs: a benchmark's
    whole pipeline in seconds on a CPU, without loading SmolLM2. With ``tokenizer`` its vocabulary
    and special tokens are the tokenizer's (whose pad token is set to eos when it has none)."""
    import torch
    import transformers

    special = {}
    if tokenizer is not None:
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        vocab_size = len(tokenizer)
        special = dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        **special,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


def sync_device(device) -> None:
    """Wait for the device's queued work, so a timing ends when the work does (nothing on a CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
