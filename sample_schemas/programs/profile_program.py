"""The personalization profile (sample_schemas/personalization.xml) written as a prompt program.

    pml-studio compile sample_schemas/programs/profile_program.py:learner_profile

prints profile_program.xml; EXAMPLE below is the call behind profile_program.prompt.xml.
"""

from engine.programs import Param, prompt_program, system


@prompt_program
def goal(topic: Param(len=8), weeks: Param(len=3, default="four")):
    ("Goal: I want to get comfortable with " + topic + " within the next " + weeks + " weeks. I can study for "
     "about thirty minutes a day, five days a week.")


@prompt_program
def learner_profile(style: str, level: str, tone: str = "casual", topic=None, weeks=None, examples: bool = False):
    system("You are a patient tutor who adapts every explanation to the learner described in the user's message: "
           "their learning style, their level and the tone they prefer. Keep plans concrete and realistic.")
    match style:
        case "visual":
            ("Learning style: visual. I remember ideas best when I can see them, so diagrams, tables, timelines "
             "and color-coded notes help me far more than long paragraphs.")
        case "verbal":
            ("Learning style: verbal. I learn best through words: clear written explanations, talking ideas "
             "through, and summarizing each step in my own sentences before moving on.")
        case "hands-on":
            ("Learning style: hands-on. I understand things by doing them, so I prefer short exercises, small "
             "projects and trying examples myself right after a brief explanation.")
    if level == "beginner":
        ("Level: beginner. I am new to this subject and do not know its basic terms yet, so please define new "
         "words and start from first principles.")
    elif level == "intermediate":
        ("Level: intermediate. I know the basics and have practiced a little, but I still make mistakes with the "
         "harder parts and want to fill the gaps.")
    elif level == "expert":
        ("Level: expert. I already use this subject in my work, so skip the fundamentals and focus on edge cases, "
         "trade-offs and ways to sharpen my skills.")
    match tone:
        case "formal":
            ("Tone: formal. Please write in a polite, professional register with complete sentences, and avoid "
             "slang, jokes and emoji.")
        case "casual":
            ("Tone: casual. Talk to me like a friendly study partner: relaxed, direct and encouraging, in plain "
             "everyday language.")
        case "playful":
            ("Tone: playful. Keep things light: a bit of humor, vivid comparisons and small challenges make "
             "studying feel like a game to me.")
    if examples:
        "Whenever you introduce an idea, follow it with one short worked example."
    goal(topic=topic, weeks=weeks)


EXAMPLE = learner_profile.bind(
    style="visual", level="beginner", tone="casual", topic="basic statistics",
    question="Write a short study plan for my first week: one line for each study day.")
