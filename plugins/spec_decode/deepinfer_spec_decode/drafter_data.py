"""Training and held-out prompts for drafter self-distillation, built only from text already on the machine.

Sources: CPython's standard-library modules (their docstrings and source lines), the README /
METADATA texts of installed packages (``importlib.metadata``) and a hand-written list of everyday
subjects. Passages cut from them fill templated instructions of several kinds — chat questions, code,
summaries, lists, practical advice, short creative writing — for chat models, or serve as continuation
prompts for base models (Gemma-3-270M). The everyday kinds keep the training replies from being all
about software. The replies come from the target itself (``drafter_training``), so no dataset is
downloaded.

The held-out prompts use templates and passages the training prompts never use (the passage pool is
split before any prompt is made), so held-out acceptance measures generalization to unseen text.
"""

from __future__ import annotations

import ast
import importlib.metadata
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

KINDS = ("question", "code", "summary", "list", "advice", "creative")

# Templates per kind; the last ``HELD_OUT_TEMPLATES`` of each kind are held out (used only for held-out
# prompts). Many phrasings per kind keep the drafter from learning one template's reply openings.
HELD_OUT_TEMPLATES = 2
TEMPLATES: dict[str, tuple[str, ...]] = {
    "question": (
        "What is {topic}? Explain it briefly.",
        "Can you tell me about {topic} in a few sentences?",
        "Why would someone use {topic}?",
        "Explain {topic} to a beginner.",
        "How does {topic} work?",
        "I keep hearing about {topic}. What is it for?",
        "When should I use {topic}, and when not?",
        "Describe {topic} in one paragraph.",
        "What problem does {topic} solve?",
        "Compare {topic} with a simpler alternative.",
        "What are the main ideas behind {topic}?",
        "Teach me the basics of {topic}.",
    ),
    "code": (
        "Explain what this Python code does:\n\n{code}",
        "Write a short docstring for this function:\n\n{code}",
        "Is there a bug in this code? Explain.\n\n{code}",
        "Rewrite this code to be more readable:\n\n{code}",
        "Add comments to this code:\n\n{code}",
        "What does this function return?\n\n{code}",
        "Write a unit test for this function:\n\n{code}",
        "How could this code be made faster?\n\n{code}",
        "Translate this Python code into plain English:\n\n{code}",
        "What inputs would make this code fail?\n\n{code}",
        "Describe the purpose of each line:\n\n{code}",
        "Review this code as a senior engineer would:\n\n{code}",
    ),
    "summary": (
        "Summarize the following text in two sentences:\n\n{text}",
        "What is the main point of this passage?\n\n{text}",
        "Give a one-paragraph summary:\n\n{text}",
        "Explain this text in simple words:\n\n{text}",
        "Summarize this for a busy reader:\n\n{text}",
        "What are the key takeaways of this text?\n\n{text}",
        "Rewrite this passage more concisely:\n\n{text}",
        "Give this text a title and a one-line summary:\n\n{text}",
        "What questions does this passage answer?\n\n{text}",
        "Summarize the following in three bullet points:\n\n{text}",
        "Write a short summary of this:\n\n{text}",
        "Tell me what this text is about:\n\n{text}",
    ),
    "list": (
        "List three facts about {topic}.",
        "Give me a numbered list of steps to learn {topic}.",
        "What are five things to know about {topic}? Answer as a list.",
        "List the pros and cons of {topic}.",
        "List common mistakes people make with {topic}.",
        "Give a checklist for using {topic} well.",
        "List four questions a beginner might ask about {topic}.",
        "Name some alternatives to {topic}, as a list.",
        "List the key terms related to {topic} with one-line definitions.",
        "Outline a short tutorial on {topic} as numbered steps.",
        "Make a bulleted list of tips for working with {topic}.",
        "List three use cases for {topic}.",
    ),
    "advice": (
        "How do I get better at {subject}?",
        "Give me some practical advice about {subject}.",
        "I am new to {subject}. Where should I start?",
        "What should I know before {subject}?",
        "What are the most common mistakes in {subject}?",
        "How can I save time when {subject}?",
        "My friend asked me about {subject}. What should I tell them?",
        "Explain how to plan for {subject} step by step.",
        "What is a good routine for {subject}?",
        "How do experts approach {subject}?",
        "What would you recommend for someone struggling with {subject}?",
        "Give three tips for {subject}.",
    ),
    "creative": (
        "Write a short story about {subject}.",
        "Write a short poem about {subject}.",
        "Write a friendly email to a colleague about {subject}.",
        "Describe a memorable moment of {subject}.",
        "Write a dialogue between two friends about {subject}.",
        "Write a diary entry about {subject}.",
        "Write a short speech about {subject}.",
        "Write a product description related to {subject}.",
        "Write a funny paragraph about {subject}.",
        "Write a letter to your future self about {subject}.",
        "Write a blog post introduction about {subject}.",
        "Write a short scene set during {subject}.",
    ),
}

# Everyday subjects for the ``advice`` and ``creative`` kinds (gerund phrases and nouns that fit both
# kinds' templates). Hand-written: the machine's own texts are almost all about software.
SUBJECTS = (
    "cooking dinner for a family", "baking bread", "learning to swim", "training for a marathon",
    "planting a vegetable garden", "caring for houseplants", "moving to a new city", "starting a new job",
    "preparing for a job interview", "writing a resume", "saving money each month", "paying off debt",
    "planning a wedding", "organizing a birthday party", "traveling on a budget", "camping in the mountains",
    "hiking with children", "learning a foreign language", "learning to play the guitar", "practicing the piano",
    "painting with watercolors", "taking better photographs", "keeping a journal", "reading more books",
    "sleeping better", "waking up early", "eating healthier", "drinking more water", "running a small business",
    "selling handmade crafts", "negotiating a salary", "managing a team", "working from home",
    "studying for exams", "teaching a child to read", "raising a puppy", "adopting a cat",
    "riding a bicycle in the city", "driving in snow", "buying a used car", "renting a first apartment",
    "decorating a small room",
    "cleaning the kitchen", "doing laundry", "fixing a leaking tap", "building a bookshelf", "recycling at home",
    "reducing food waste", "composting", "volunteering in the community", "making new friends as an adult",
    "dealing with stress", "giving a presentation", "public speaking", "writing a thank-you note",
    "hosting guests for the weekend", "visiting grandparents", "a rainy afternoon", "a snowy morning",
    "the first day of school", "a long train journey", "a trip to the seaside", "a night under the stars",
    "a visit to a museum", "a farmers market", "a summer festival", "a thunderstorm", "an old lighthouse",
    "a small bakery", "a forgotten library book", "a lost umbrella", "a city at night", "autumn leaves",
    "the ocean", "the moon", "a mountain village", "a busy airport", "a quiet cafe", "a football match",
    "playing chess", "solving puzzles", "knitting a scarf", "brewing coffee", "making tea", "grilling vegetables",
    "packing for a trip", "choosing a gift", "writing a novel", "starting a podcast", "learning to draw",
    "staying motivated", "setting goals for the new year", "keeping a budget", "shopping for groceries",
    "walking the dog", "birdwatching", "fishing on a lake", "skiing for the first time", "learning to dance",
    "singing in a choir", "taking care of an elderly parent", "preparing for a storm", "changing a flat tire",
    "learning to code", "using a spreadsheet", "sending a difficult email", "apologizing to a friend",
    "celebrating a holiday", "cooking for a picnic", "a power outage", "a job well done", "a new neighbor",
)


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``kind`` (one of ``KINDS``, or ``continuation`` for base models) and its text (a user
    message for chat models, the text to continue for base models)."""

    kind: str
    text: str


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))


def _functions_and_docs(path: Path, max_lines: int) -> tuple[list[str], list[str]]:
    """Short function sources and long-enough docstrings of one module (nothing on a parse error)."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return [], []
    lines = source.splitlines()
    code, docs = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.Module):
            doc = ast.get_docstring(node)
            if doc and 200 <= len(doc) <= 1500:
                docs.append(doc)
        if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
            body = lines[node.lineno - 1:node.end_lineno]
            if 4 <= len(body) <= max_lines:
                code.append("\n".join(body))
    return code, docs


def _package_texts() -> list[str]:
    """Paragraphs of installed packages' descriptions (README / METADATA bodies)."""
    paragraphs = []
    for dist in importlib.metadata.distributions():
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        text = body if isinstance(body, str) else ""
        for para in text.split("\n\n"):
            para = " ".join(para.split())
            if 200 <= len(para) <= 1200 and not para.startswith(("#", "|", "```", "<", "[!", "..")):
                paragraphs.append(para)
    return sorted(set(paragraphs))


def _topics(docs: list[str], modules: list[str]) -> list[str]:
    """Noun phrases: docstring first lines that start with an article (``"a class that represents a
    thread of control"``) and ``"the Python <module> module"`` for each standard-library module."""
    topics = {f"the Python {name} module" for name in modules}
    for doc in docs:
        first = doc.strip().splitlines()[0].rstrip(".").strip()
        if 12 <= len(first) <= 60 and first.lower().startswith(("a ", "an ", "the ")):
            topics.add(first[0].lower() + first[1:])
    return sorted(topics)


@dataclass(frozen=True)
class Passages:
    """The pools prompts draw from: code snippets, prose passages, topics and everyday subjects."""

    code: list[str]
    text: list[str]
    topics: list[str]
    subjects: list[str]

    def split(self, held_out_fraction: float, rng: random.Random) -> tuple[Passages, Passages]:
        """Disjoint (training, held-out) pools."""
        parts: list[tuple[list[str], list[str]]] = []
        for pool in (self.code, self.text, self.topics, self.subjects):
            shuffled = pool[:]
            rng.shuffle(shuffled)
            cut = max(1, int(len(shuffled) * held_out_fraction))
            parts.append((shuffled[cut:], shuffled[:cut]))
        return Passages(*(p[0] for p in parts)), Passages(*(p[1] for p in parts))


def local_passages(max_code_lines: int = 16) -> Passages:
    """Every passage this machine offers (deterministic order)."""
    code, docs = [], []
    files = _stdlib_files()
    for path in files:
        c, d = _functions_and_docs(path, max_code_lines)
        code.extend(c)
        docs.extend(d)
    text = sorted(set(docs)) + _package_texts()
    return Passages(sorted(set(code)), text, _topics(docs, [p.stem for p in files]), sorted(set(SUBJECTS)))


def _fill(kind: str, template: str, pool: Passages, rng: random.Random) -> str:
    if kind == "code":
        return template.format(code=rng.choice(pool.code))
    if kind == "summary":
        return template.format(text=rng.choice(pool.text))
    if kind in ("advice", "creative"):
        return template.format(subject=rng.choice(pool.subjects))
    return template.format(topic=rng.choice(pool.topics))


def chat_prompts(n: int, pool: Passages, rng: random.Random, *, held_out: bool) -> list[Prompt]:
    """``n`` user messages, kinds in turn; held-out prompts use only each kind's last
    ``HELD_OUT_TEMPLATES`` templates, training prompts the others."""
    prompts = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        cut = len(TEMPLATES[kind]) - HELD_OUT_TEMPLATES
        templates = TEMPLATES[kind][cut:] if held_out else TEMPLATES[kind][:cut]
        prompts.append(Prompt(kind, _fill(kind, rng.choice(templates), pool, rng)))
    return prompts


def continuation_prompts(n: int, pool: Passages, rng: random.Random, *, max_chars: int = 400) -> list[Prompt]:
    """``n`` texts for a base model to continue: the opening of a passage or a code snippet."""
    prompts = []
    for i in range(n):
        source = pool.code if i % 3 == 2 else pool.text
        passage = rng.choice(source)
        prompts.append(Prompt("continuation", passage[:max_chars]))
    return prompts
