"""Chat prompts for training and evaluating the SmolLM2 draft, built here without any download.

Three families, as the DFlash recipe wants prompts whose answers the target writes itself:
- questions written from the Python standard library's own documentation (module and function
  names with the first line of their docstrings),
- code tasks (templates × tasks),
- general chat (templates × topics).
The held-out set (HELD_OUT) is written separately: its topics, tasks and modules never appear in
the training prompts, so acceptance measured on it is acceptance on prompts the draft never saw.
"""
from __future__ import annotations

import importlib
import inspect
import random

TRAIN_TOPICS = """photosynthesis;the water cycle;black holes;the French Revolution;climate change;vaccines;
the stock market;machine learning;the Roman Empire;volcanoes;gravity;DNA;the internet;democracy;inflation;
renewable energy;the human heart;earthquakes;the Moon;electric cars;coffee;sleep;exercise;meditation;
the Renaissance;World War I;the printing press;bees;rainforests;the immune system;plate tectonics;
quantum computing;blockchain;recycling;the Olympic Games;jazz;chess;the solar system;hurricanes;
the Great Wall of China;ancient Egypt;the periodic table;nutrition;time management;public speaking;
the theory of evolution;antibiotics;social media;cloud computing;the Industrial Revolution;tides;
rainbows;dinosaurs;the ozone layer;marathon training;gardening;budgeting;learning a language;
the speed of light;magnets;bread baking;the moon landing;glaciers;coral reefs;the brain;memory;
interest rates;supply and demand;operating systems;databases;encryption;the Pythagorean theorem;
prime numbers;probability;statistics;the Cold War;the Silk Road;Shakespeare;opera;photography""".replace("\n", " ")

TRAIN_COUNTRIES = """Germany;Italy;Spain;Japan;Brazil;Canada;Australia;India;Mexico;Egypt;Kenya;Norway;Sweden;
Argentina;Chile;Peru;Greece;Turkey;Poland;Portugal;Ireland;Thailand;Vietnam;Nigeria;Morocco""".replace("\n", " ")

CHAT_TEMPLATES = [
    "What is {t}?", "Explain {t} in simple terms.", "Can you tell me about {t}?",
    "Give me three interesting facts about {t}.", "Why is {t} important?", "Write a short paragraph about {t}.",
    "How would you explain {t} to a child?", "What are the main ideas behind {t}?",
    "Summarize {t} in a few sentences.", "What are common misconceptions about {t}?",
    "Write a short poem about {t}.", "What should a beginner know about {t}?",
]
COUNTRY_TEMPLATES = ["What is the capital of {c}?", "What language is spoken in {c}?",
                     "Tell me about the culture of {c}.", "What is {c} famous for?",
                     "Suggest a three-day travel plan for {c}."]

TRAIN_TASKS = """reverses a string;checks whether a number is prime;computes the factorial of n;
returns the n-th Fibonacci number;counts the vowels in a string;checks whether a string is a palindrome;
finds the largest element in a list;removes duplicates from a list while keeping order;
merges two sorted lists;flattens a nested list;computes the average of a list of numbers;
converts Celsius to Fahrenheit;counts word frequencies in a text;sorts a list of dictionaries by a key;
finds the second largest number in a list;checks whether two strings are anagrams;
computes the greatest common divisor of two numbers;reads a text file and counts its lines;
implements binary search;transposes a matrix;returns the squares of the even numbers in a list;
capitalizes every word in a sentence;validates an email address with a regular expression;
generates a random password;computes the sum of the digits of an integer;
converts a decimal number to binary;finds the common elements of two lists;
implements a stack class;implements a queue with two stacks;computes the power set of a list;
rotates a list by k positions;checks whether a year is a leap year;splits a list into chunks of size n""".replace("\n", " ")

CODE_TEMPLATES = ["Write a Python function that {k}.", "How do I write a function in Python that {k}?",
                  "Write a Python program that {k}, with a short explanation.",
                  "Show me Python code that {k}.", "Write a JavaScript function that {k}."]

DOC_TEMPLATES = ["What does {name} do in Python?", "How do I use {name} in Python? Give an example.",
                 "Explain the Python function {name}.", "What is the purpose of the {module} module in Python?"]

TRAIN_MODULES = ("json", "os", "os.path", "re", "itertools", "functools", "collections", "math", "random",
                 "datetime", "string", "pathlib", "subprocess", "shutil", "csv", "statistics", "time",
                 "sys", "copy", "bisect", "operator", "glob", "hashlib", "base64", "urllib.parse",
                 "difflib", "secrets", "uuid", "zipfile", "tempfile", "pprint", "enum", "dataclasses",
                 "typing", "argparse", "logging", "sqlite3", "threading", "unicodedata", "struct")

# Held out: none of these topics, countries, tasks or modules is in the lists above.
HELD_OUT = [
    "What is the capital of France?",
    "Explain how airplanes stay in the air.",
    "Can you tell me about the history of the bicycle?",
    "Give me three tips for writing a good essay.",
    "What are the health benefits of drinking water?",
    "Write a short poem about autumn leaves.",
    "How would you explain electricity to a child?",
    "What is the difference between weather and climate?",
    "Summarize the story of Romeo and Juliet.",
    "What should I pack for a weekend camping trip?",
    "Why do cats purr?",
    "What is the tallest mountain in the world?",
    "How does a refrigerator keep food cold?",
    "What causes the seasons on Earth?",
    "Give me a recipe for pancakes.",
    "What is the capital of Switzerland?",
    "Write a Python function that checks whether a list is sorted.",
    "Write a Python function that counts the uppercase letters in a string.",
    "How do I use heapq.heappush in Python? Give an example.",
    "What does textwrap.wrap do in Python?",
    "Explain the Python function shlex.split.",
    "What is the purpose of the fractions module in Python?",
    "Write a Python class that represents a bank account with deposit and withdraw methods.",
    "What are the benefits of reading books?",
    "How can I become a better listener?",
    "Explain what a neural network is.",
    "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between a virus and a bacterium?",
    "Write a haiku about the ocean.",
    "How do I make a good cup of tea?",
    "What are the primary colors?",
]


def split(text: str) -> list[str]:
    return [item.strip() for item in text.split(";") if item.strip()]


def doc_prompts(rng: random.Random) -> list[str]:
    """Questions about functions of the standard library, named from the modules themselves."""
    prompts = []
    for module_name in TRAIN_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        prompts.append(DOC_TEMPLATES[3].format(module=module_name, name=module_name))
        names = [n for n, obj in vars(module).items() if not n.startswith("_") and callable(obj)
                 and (inspect.getdoc(obj) or "").strip() and (getattr(obj, "__module__", None) or "").split(".")[0]
                 in (module_name.split(".")[0], "posixpath", "_" + module_name.split(".")[0])]
        for name in sorted(names)[:40]:
            template = rng.choice(DOC_TEMPLATES[:3])
            prompts.append(template.format(name=f"{module_name}.{name}", module=module_name))
    return prompts


def train_prompts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prompts = [t.format(t=topic) for topic in split(TRAIN_TOPICS) for t in CHAT_TEMPLATES]
    prompts += [t.format(c=c) for c in split(TRAIN_COUNTRIES) for t in COUNTRY_TEMPLATES]
    prompts += [t.format(k=task) for task in split(TRAIN_TASKS) for t in CODE_TEMPLATES]
    prompts += doc_prompts(rng)
    held = set(HELD_OUT)
    prompts = sorted(set(p for p in prompts if p not in held))
    rng.shuffle(prompts)
    return prompts


if __name__ == "__main__":
    import json
    import sys
    out = sys.argv[1] if len(sys.argv) > 1 else "prompts.jsonl"
    prompts = train_prompts()
    with open(out, "w") as f:
        for p in prompts:
            f.write(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n")
    print(len(prompts), "prompts;", len(HELD_OUT), "held out")
