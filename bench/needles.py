"""Varied needles: facts of several templates with invented names, places and short phrases as answers.

"The special magic number for the X project is N" is easy for a model that answers (the 0.5B model
finds it whatever the cache does) and says nothing about *which document* a fact came from. These
needles are harder and more varied (issue 17, item 5; issue 18, item 4):

* each :class:`Fact` template has its own subjects (towns, islands, painters, inns, ...) and answers
  (pet names, colours, villages, dishes, two-word passwords) — invented, so the essays never hold
  them, and none a substring of another in the same template;
* :func:`varied_cases` — one target fact at a varied depth plus ``distractors`` facts of *other*
  templates in other modules (several needles per prompt, one asked);
* :func:`confusable_cases` — every module holds a fact of the *same* template about another subject
  (a harbour master's parrot in each of eight towns); the question names one subject, so the model
  must tell the documents apart.

:func:`judge` scores an answer: found = the target's answer appears in it (case, quotes and
punctuation ignored, whole words); confused = another module's answer does and the target's not
(:func:`judge_case` judges a magic-number case too). :func:`make_workload` builds the mixed workload's modules and
prompts from the same templates. Cases are plain dicts with the keys bench/fidelity.py reads (``question``,
``answer``, ``others``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from xml.sax.saxutils import escape

from bench.workloads import insert


@dataclass(frozen=True)
class Fact:
    kind: str
    sentence: str  # "{s}" subject, "{v}" answer
    ask: str  # the question, "{s}" subject
    subjects: tuple[str, ...]
    answers: tuple[str, ...]
    ask_two: str = ""  # the natural question about two subjects, "{a}" and "{b}"
    ask_all: str = ""  # the question about every subject in the documents

    def say(self, subject: str, answer: str) -> str:
        return self.sentence.format(s=subject, v=answer)

    def question(self, subject: str) -> str:
        return f"Question: {self.ask.format(s=subject)} Answer in a few words, using the documents. Answer:"


FACTS = (
    Fact("parrot", "The harbour master of {s} keeps a parrot called {v}.",
         "What is the name of the parrot kept by the harbour master of {s}?",
         ("Porthleven", "Kilbrannan", "Saltcombe", "Dunmarrow", "Westhaven", "Eastmere", "Tollbridge", "Fenwick Bay",
          "Ardmore", "Caldbeck"),
         ("Biscuit", "Admiral Crumb", "Marzipan", "Captain Fig", "Toffee", "Sergeant Plum", "Whistler", "Pumpernickel",
          "Lady Gumdrop", "Nutmeg"),
         ask_two='What are the names of the parrots kept by the harbour masters of {a} and of {b}?',
         ask_all='What are the names of all the parrots kept by the harbour masters in these documents?'),
    Fact("lighthouse", "The lighthouse on {s} is painted {v}.", "What colour is the lighthouse on {s} painted?",
         ("Skerrow Isle", "Barra Rock", "Holm Island", "Gull Point", "Raven Skerry", "Fair Holm", "Sula Rock",
          "Mingay", "Copeland Isle", "Oxna"),
         ("pale green", "crimson", "mustard yellow", "sky blue", "charcoal grey", "burnt orange", "lilac", "teal",
          "salmon pink", "violet"),
         ask_two='What colours are the lighthouses on {a} and on {b} painted?',
         ask_all='What colours are all the lighthouses in these documents painted?'),
    Fact("tea", "The librarian of {s} drinks nothing but {v} tea.", "Which tea does the librarian of {s} drink?",
         ("Ashby Parva", "Thornfield", "Marlow Green", "Penrith Cross", "Oldcastle", "Brackenwood", "Fairhope",
          "Millbrook", "Haddon Vale", "Stourton"),
         ("jasmine", "rooibos", "oolong", "hibiscus", "peppermint", "chamomile", "lapsang souchong", "genmaicha",
          "lemon verbena", "darjeeling"),
         ask_two='Which teas do the librarians of {a} and of {b} drink?',
         ask_all='Which teas do all the librarians in these documents drink?'),
    Fact("password", "The password for the {s} archive is {v}.", "What is the password for the {s} archive?",
         ("Harlow", "Quenby", "Ostwick", "Pellham", "Varrow", "Linstead", "Colbury", "Dranmore", "Ettrick", "Sowerby"),
         ("silver kettle", "quiet orchard", "paper lantern", "copper fox", "velvet anchor", "winter plum",
          "glass heron", "amber tide", "rusty compass", "midnight tulip"),
         ask_two='What are the passwords for the {a} archive and for the {b} archive?',
         ask_all='What are the passwords of all the archives in these documents?'),
    Fact("painter", "The painter {s} was born in the village of {v}.", "In which village was the painter {s} born?",
         ("Ilse Marrow", "Tomas Brindle", "Odile Vane", "Rafe Cotter", "Maren Holt", "Silas Quint", "Agathe Lune",
          "Bram Ketter", "Nell Dorrit", "Jory Penhale"),
         ("Little Dunsop", "Hessle Ford", "Brackwater", "Oxney Cross", "Pennock", "Yarrowby", "Stillwell",
          "Cobham Vale", "Wetherden", "Ludgvan"),
         ask_two='In which villages were the painters {a} and {b} born?',
         ask_all='In which villages were all the painters in these documents born?'),
    Fact("ferry", "The ferry captain of {s} named her boat the {v}.",
         "What did the ferry captain of {s} name her boat?",
         ("Lismore", "Colonsay", "Rathlin", "Eigg", "Muck", "Kerrera", "Gigha", "Ulva", "Luing", "Shuna"),
         ("Morning Star", "Blue Heron", "Saucy Meg", "Northern Lass", "Kittiwake", "Silver Darling", "Good Hope",
          "Marigold", "Sea Swallow", "Brave Otter"),
         ask_two='What did the ferry captains of {a} and of {b} name their boats?',
         ask_all='What did all the ferry captains in these documents name their boats?'),
    Fact("inn", "The cook at the {s} inn is famous for {v}.", "What is the cook at the {s} inn famous for?",
         ("Three Owls", "Golden Pike", "Crooked Billet", "Lamb and Flag", "White Hart", "Drowsy Swan", "Old Bell",
          "Wheatsheaf", "Fox and Hounds", "Green Man"),
         ("plum dumplings", "smoked eel soup", "nettle pie", "saffron buns", "rabbit stew", "treacle tart",
          "crab cakes", "barley bread", "damson jam", "cider pork"),
         ask_two='What are the cooks at the {a} inn and at the {b} inn famous for?',
         ask_all='What are the cooks at all the inns in these documents famous for?'),
)


def varied_cases(chunks: list[str], n_modules: int, count: int, seed: int, distractors: int = 2,
                 depths: tuple[float, ...] = (0.1, 0.5, 0.9)) -> list[dict]:
    """``count`` prompts of ``n_modules`` essay modules: one target fact (its template cycling through
    :data:`FACTS`) in the module at ``depth``, and ``distractors`` facts of other templates in other modules."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        start = rng.randrange(0, len(chunks) - n_modules)
        docs = list(chunks[start:start + n_modules])
        depth = depths[i % len(depths)]
        target = min(n_modules - 1, int(depth * n_modules))
        asked = FACTS[i % len(FACTS)]
        kinds = [asked] + rng.sample([f for f in FACTS if f is not asked], min(distractors, len(FACTS) - 1))
        where = [target] + rng.sample([j for j in range(n_modules) if j != target], min(distractors, n_modules - 1))
        said = []
        for fact, j in zip(kinds, where):
            subject, answer = rng.choice(fact.subjects), rng.choice(fact.answers)
            docs[j] = insert(docs[j], fact.say(subject, answer), rng.random())
            said.append((fact, subject, answer))
        fact, subject, answer = said[0]
        out.append(_case(n_modules, depth, target, fact, subject, answer, [a for _, _, a in said[1:]], docs))
    return out


def confusable_cases(chunks: list[str], n_modules: int, count: int, seed: int,
                     depths: tuple[float, ...] = (0.1, 0.5, 0.9)) -> list[dict]:
    """``count`` prompts of ``n_modules`` essay modules, each module holding a fact of one template
    (cycling through :data:`FACTS`) about its own subject with its own answer; the question names the
    subject of the module at ``depth``."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        fact = FACTS[i % len(FACTS)]
        docs, subjects, answers = _confusable_docs(rng, chunks, n_modules, fact)
        depth = depths[i % len(depths)]
        target = min(n_modules - 1, int(depth * n_modules))
        out.append(_case(n_modules, depth, target, fact, subjects[target], answers[target],
                         [a for j, a in enumerate(answers) if j != target], docs))
    return out


def two_fact_cases(chunks: list[str], n_modules: int, count: int, seed: int) -> list[dict]:
    """``count`` confusable prompts (:func:`confusable_cases`: every module a fact of one template about its own
    subject) whose question names *two* subjects, whose facts sit in two different modules: found = both answers
    are in the reply, each with its own subject (:func:`judge`)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        fact = FACTS[i % len(FACTS)]
        docs, subjects, answers = _confusable_docs(rng, chunks, n_modules, fact)
        first, second = sorted(rng.sample(range(n_modules), 2))
        question = (f"Question: {fact.ask.format(s=subjects[first])} And {fact.ask.format(s=subjects[second])} "
                    "Answer both in a few words, using the documents. Answer:")
        case = _case(n_modules, first / n_modules, first, fact, f"{subjects[first]} + {subjects[second]}",
                     f"{answers[first]} + {answers[second]}",
                     [a for j, a in enumerate(answers) if j not in (first, second)], docs)
        out.append({**case, "question": question, "answers": [answers[first], answers[second]],
                    "subjects": [subjects[first], subjects[second]], "needle_modules": [first, second]})
    return out


# How a question about two subjects, or about every subject, is put (bench/spanning.py): the thresholds and rules of
# the routed arm are chosen on one split of these and reported on another, in every phrasing.
TWO_PHRASINGS = {
    "both": lambda f, a, b: f"Question: {f.ask.format(s=a)} And {f.ask.format(s=b)} Answer both in a few words, "
                            "using the documents. Answer:",
    "natural": lambda f, a, b: f"{f.ask_two.format(a=a, b=b)} Answer in a few words.",
    "value-first": lambda f, a, b: f"{f.ask_two.format(a=a, b=b)} Give each answer first, then whom or what it "
                                   "belongs to.",
}
ALL_PHRASINGS = {
    "list": lambda f: f"Question: {f.ask_all} List every one, using the documents. Answer:",
    "natural": lambda f: f"{f.ask_all} Answer in a few words.",
    "value-first": lambda f: f"{f.ask_all} Give each answer first, then whom or what it belongs to.",
}


def phrased_two_fact_cases(chunks: list[str], n_modules: int, count: int, seed: int, phrasing: str) -> list[dict]:
    """:func:`two_fact_cases` with the question put as :data:`TWO_PHRASINGS` ``[phrasing]`` says."""
    ask = TWO_PHRASINGS[phrasing]
    out = []
    for case in two_fact_cases(chunks, n_modules, count, seed):
        fact = next(f for f in FACTS if f.kind == case["kind"])
        out.append({**case, "question": ask(fact, *case["subjects"]), "phrasing": phrasing})
    return out


def aggregate_cases(chunks: list[str], n_modules: int, count: int, seed: int, phrasing: str) -> list[dict]:
    """``count`` confusable prompts whose question needs every module: every subject's answer (the reply's recall,
    :func:`recall`), put as :data:`ALL_PHRASINGS` ``[phrasing]`` says."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        fact = FACTS[i % len(FACTS)]
        docs, subjects, answers = _confusable_docs(rng, chunks, n_modules, fact)
        case = _case(n_modules, 0.0, 0, fact, " + ".join(subjects), " + ".join(answers), [], docs)
        out.append({**case, "question": ALL_PHRASINGS[phrasing](fact), "answers": answers, "subjects": subjects,
                    "needle_modules": list(range(n_modules)), "phrasing": phrasing})
    return out


def make_workload(chunks: list[str], n_modules: int, n_prompts: int, seed: int,
                  templates: int = 3) -> tuple[list[str], list[dict]]:
    """(module texts, prompts: imports, the asked module, its question and answer, the schema-order flag).

    Every module holds one fact of each of ``templates`` templates (:data:`FACTS`), about its own
    subject with its own answer — a harbour master's parrot in each of eight towns, and so on — so a
    prompt's modules hold confusable facts and the question names one subject."""
    rng = random.Random(seed)
    start = rng.randrange(0, len(chunks) - n_modules)
    kinds = rng.sample(FACTS, templates)
    said = {f.kind: (rng.sample(f.subjects, n_modules), rng.sample(f.answers, n_modules)) for f in kinds}
    docs = []
    for i in range(n_modules):
        doc = chunks[start + i]
        for f in kinds:
            doc = insert(doc, f.say(said[f.kind][0][i], said[f.kind][1][i]), rng.random())
        docs.append(doc)
    ordered = set(rng.sample(range(n_prompts), max(1, round(n_prompts / 4))))
    prompts = []
    for i in range(n_prompts):
        k = rng.randint(2, min(4, n_modules))
        if i in ordered:
            imports = list(range(k))
        else:
            imports = list(range(k))
            while imports == list(range(k)):  # anything but a run from the first module
                imports = sorted(rng.sample(range(n_modules), k))
        asked = rng.choice(imports)
        f = kinds[i % templates]
        subjects, answers = said[f.kind]
        prompts.append({"imports": imports, "asked": asked, "kind": f.kind, "subject": subjects[asked],
                        "question": f.question(subjects[asked]), "answer": answers[asked],
                        "others": [a for j, a in enumerate(answers) if j != asked], "schema_order": i in ordered})
    return docs, prompts


def prompt_xml(p: dict) -> str:
    return ('<prompt schema="workload">' + "".join(f"<doc{i}/>" for i in p["imports"])
            + f" {escape(p['question'])}</prompt>")


def recall(answer: str, case: dict) -> float:
    """The share of the case's answers the reply gives (whole words, case and punctuation ignored)."""
    said = _words(answer)
    return sum(_words(a) in said for a in case["answers"]) / len(case["answers"])


def _confusable_docs(rng: random.Random, chunks: list[str], n_modules: int, fact: Fact) -> tuple[list, list, list]:
    """(docs, subjects, answers): ``n_modules`` consecutive essay chunks, module j holding ``fact`` about subject j."""
    start = rng.randrange(0, len(chunks) - n_modules)
    docs = list(chunks[start:start + n_modules])
    subjects, answers = rng.sample(fact.subjects, n_modules), rng.sample(fact.answers, n_modules)
    for j in range(n_modules):
        docs[j] = insert(docs[j], fact.say(subjects[j], answers[j]), rng.random())
    return docs, subjects, answers


def judge(answer: str, case: dict) -> tuple[bool, bool]:
    """(found, confused) for a model's answer to ``case``: whole-word match, case and punctuation ignored. A
    two-fact case is found when both its answers are *and each goes with its own subject* (:func:`bound`); both
    answers given to the wrong subjects counts as confused."""
    said = _words(answer)
    answers = case.get("answers") or [case["answer"]]
    present = all(_words(a) in said for a in answers)
    found = present and (len(answers) < 2 or bound(said, answers, case.get("subjects") or []))
    return found, not found and (present or any(_words(o) in said for o in case["others"]))


def judge_case(text: str, case: dict) -> tuple[bool, bool]:
    """(found, confused): a varied needle's answer by :func:`judge`, a magic number (bench/workloads.py) by its
    digits."""
    if "answer" in case:
        return judge(text, case)
    text = text.replace(",", "")
    found = case["number"] in text
    return found, not found and any(o in text for o in case["others"])


def bound(said: str, answers: list[str], subjects: list[str]) -> bool:
    """True when two answers, both in ``said`` (:func:`_words` form), come in the order of their subjects there:
    "A's parrot is X. B's parrot is Y" and "In Y, B was born; in X, A was born" bind each answer to its own
    subject, "A's parrot is Y. B's parrot is X" does not. Subjects not both named: the question's order."""
    at = [said.find(_words(a)) for a in answers]
    named = [said.find(_words(x)) for x in subjects]
    same_order = named[0] < named[1] if len(named) == 2 and min(named) >= 0 and named[0] != named[1] else True
    return (at[0] < at[1]) == same_order


def _words(text: str) -> str:
    return " " + " ".join(re.findall(r"[a-z0-9]+", text.lower())) + " "


def _case(n_modules, depth, target, fact, subject, answer, others, docs) -> dict:
    # "name"/"number" too: the keys the magic-number cases use (bench/fidelity.py prints them)
    return {"modules": n_modules, "depth": depth, "needle_module": target, "kind": fact.kind, "subject": subject,
            "name": subject, "answer": answer, "number": answer, "others": others,
            "question": fact.question(subject), "docs": docs}
