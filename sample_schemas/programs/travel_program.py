"""The travel planner (sample_schemas/travel.xml) written as a prompt program.

    pml-studio compile sample_schemas/programs/travel_program.py:travel_planner

prints travel_program.xml; EXAMPLE below is the call behind travel_program.prompt.xml.
"""

from engine.programs import Param, prompt_program, system


@prompt_program
def trip_plan(duration: Param(len=4), travelers: Param(len=6, default="two adults"), region: str,
              city: Param(len=6), dest: str = "lisbon", budget: bool = False):
    "I am planning a trip of " + duration + " for " + travelers + "."
    if budget:
        "We are on a tight budget, so favor free sights, public transport and simple guesthouses."
    if region == "domestic":
        ("We want to stay in the country and spend our time in " + city + ", with a mix of museums, local food "
         "and one day outdoors. Please keep the distances between sights short.")
    elif region == "overseas":
        ("We want to travel abroad and have chosen the destination described below. Please plan one slower "
         "rest day and mention anything we should book in advance.")
        match dest:
            case "lisbon":
                ("Lisbon is a hilly capital on the Tagus estuary. Historic trams climb through the Alfama and "
                 "Graça districts, and viewpoints called miradouros look out over red rooftops. The palaces of "
                 "Sintra are about forty minutes away by train. Belém is known for its custard tarts and "
                 "riverside monuments, and evenings often end with fado music.")
            case "kyoto":
                ("Kyoto was the seat of Japan's emperors for more than a thousand years and has well over a "
                 "thousand temples and shrines. Visitors walk the gate-lined paths of Fushimi Inari, the "
                 "Arashiyama bamboo grove and the lanes of Higashiyama. Popular temples get crowded by "
                 "mid-morning, so start early. Nara, with its deer park, is about 45 minutes away by train.")
            case "reykjavik":
                ("Reykjavik, the capital of Iceland, is a compact base for exploring volcanic landscapes. The "
                 "Golden Circle route links the Thingvellir rift valley, the Geysir hot springs and Gullfoss "
                 "waterfall in one day by car. Geothermal swimming pools are part of daily life. The weather "
                 "changes quickly, so pack waterproof layers; in midwinter, daylight lasts only four to five "
                 "hours.")
            case "marrakesh":
                ("Marrakesh lies at the foot of the Atlas Mountains in Morocco. Its walled medina surrounds "
                 "Jemaa el-Fnaa, a square that fills with food stalls and musicians every evening. Many "
                 "visitors stay in riads, traditional houses built around a shaded courtyard. The Majorelle "
                 "Garden and the covered souks are highlights, and day trips reach villages in the High Atlas.")


@prompt_program
def travel_planner(duration, region, city=None, dest="lisbon", travelers=None, budget=False):
    system("You are a travel planner. Answer in a few short sentences or a brief bullet list.")
    trip_plan(duration=duration, travelers=travelers, region=region, city=city, dest=dest, budget=budget)


EXAMPLE = travel_planner.bind(
    duration="5 days", region="overseas", dest="kyoto",
    question="Question: how long is the train ride from Kyoto to Nara, and what is Nara known for? Answer in one sentence.")
