"""The varied needle sets (bench/needles.py): what each prompt holds, and how answers are judged."""

from __future__ import annotations

import re

from bench.needles import FACTS, confusable_cases, judge, varied_cases

CHUNKS = [f"Essay chunk {i} says one thing. Then it says another thing. And it ends here." for i in range(40)]


def sentences(fact, doc: str) -> list[tuple[str, str]]:
    """(subject, answer) of every sentence of ``fact``'s template in ``doc``."""
    pattern = re.escape(fact.sentence).replace(r"\{s\}", "(.+?)").replace(r"\{v\}", "(.+?)")
    return re.findall(pattern + r"(?=\s|$)", doc)


def test_templates_never_hold_an_answer_inside_another_or_a_number():
    for fact in FACTS:
        assert len(set(fact.subjects)) == len(fact.subjects) >= 8 and len(set(fact.answers)) == len(fact.answers) >= 8
        for a in fact.answers:
            assert not any(ch.isdigit() for ch in a)
            others = [b for b in fact.answers if b != a]
            assert not any(f" {a.lower()} " in f" {b.lower()} " for b in others), a


def test_a_varied_case_holds_its_fact_once_and_distractors_of_other_templates():
    for case in varied_cases(CHUNKS, 8, 14, seed=3):
        fact = next(f for f in FACTS if f.kind == case["kind"])
        where = [i for i, d in enumerate(case["docs"]) if (case["subject"], case["answer"]) in sentences(fact, d)]
        assert where == [case["needle_module"]] and len(case["docs"]) == 8
        assert case["question"] == fact.question(case["subject"])
        assert len(case["others"]) == 2
        for other in FACTS:  # the distractors use other templates: nothing else of the asked template
            if other is fact:
                assert sum(len(sentences(other, d)) for d in case["docs"]) == 1
    assert len({c["kind"] for c in varied_cases(CHUNKS, 8, 14, seed=3)}) == len(FACTS)  # templates cycle


def test_a_confusable_case_holds_one_fact_of_one_template_per_module():
    for case in confusable_cases(CHUNKS, 8, 7, seed=1):
        fact = next(f for f in FACTS if f.kind == case["kind"])
        said = [sentences(fact, d) for d in case["docs"]]
        assert all(len(s) == 1 for s in said)
        subjects = [s[0][0] for s in said]
        answers = [s[0][1] for s in said]
        assert len(set(subjects)) == len(set(answers)) == 8
        t = case["needle_module"]
        assert (subjects[t], answers[t]) == (case["subject"], case["answer"])
        assert sorted(case["others"]) == sorted(a for i, a in enumerate(answers) if i != t)


def test_judge_matches_whole_words_ignoring_case_and_punctuation():
    case = {"answer": "Admiral Crumb", "others": ["Toffee", "teal"]}
    assert judge("The parrot is called 'admiral crumb'.", case) == (True, False)
    assert judge("It is Admiral\nCrumb!", case) == (True, False)
    assert judge("It is Admiral Crumble.", case) == (False, False)  # whole words only
    assert judge("Toffee, I think.", case) == (False, True)  # another module's answer: confused
    assert judge("Admiral Crumb or Toffee", case) == (True, False)  # found wins over confused
    assert judge("He steals it.", {"answer": "x", "others": ["teal"]}) == (False, False)


def test_spanning_questions_name_their_subjects_in_every_phrasing_and_each_module_holds_one_fact():
    from bench.needles import ALL_PHRASINGS, TWO_PHRASINGS, aggregate_cases, phrased_two_fact_cases

    for phrasing in TWO_PHRASINGS:
        for case in phrased_two_fact_cases(CHUNKS, 8, 7, seed=5, phrasing=phrasing):
            a, b = case["subjects"]
            assert a in case["question"] and b in case["question"] and case["phrasing"] == phrasing
            fact = next(f for f in FACTS if f.kind == case["kind"])
            for subject, answer, module in zip(case["subjects"], case["answers"], case["needle_modules"]):
                assert (subject, answer) in sentences(fact, case["docs"][module])
    for phrasing in ALL_PHRASINGS:
        for n in (4, 8):
            for case in aggregate_cases(CHUNKS, n, 7, seed=6, phrasing=phrasing):
                fact = next(f for f in FACTS if f.kind == case["kind"])
                assert not any(s in case["question"] for s in case["subjects"])  # it names no subject
                assert [sentences(fact, d) for d in case["docs"]] == [[p] for p in zip(case["subjects"], case["answers"])]
    # the same seed draws the same prompts; another seed others (the tune and held-out splits)
    assert aggregate_cases(CHUNKS, 4, 3, 1, "list") == aggregate_cases(CHUNKS, 4, 3, 1, "list")
    assert aggregate_cases(CHUNKS, 4, 3, 1, "list") != aggregate_cases(CHUNKS, 4, 3, 2, "list")


def test_recall_is_the_share_of_the_answers_given_as_whole_words():
    from bench.needles import recall

    case = {"answers": ["Biscuit", "Captain Fig", "Toffee", "Nutmeg"]}
    assert recall("Biscuit, captain fig and TOFFEE.", case) == 0.75
    assert recall("Biscuits and Captain Figaro", case) == 0.0
    assert recall("", case) == 0.0
