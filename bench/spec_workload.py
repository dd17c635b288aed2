"""The workload of spec_bench: the copy-heavy and free-form chat prompts (repeat / edit /
extract a given text; stories and explanations) and the warm-up ones."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """One fixed chat request of a mix."""
    name: str
    task: str  # repeat | edit | extract (copy-heavy), story | explain (free-form)
    messages: tuple  # chat messages, one user turn

    @property
    def user(self) -> str:
        return self.messages[-1]["content"]


# Source texts for the copy-heavy tasks, each well over 128 tokens so that a copy of it runs
# to max_tokens. Written for this bench.
HARBOUR = (
    "The harbour at Elmsworth was rebuilt in 1887 after the great storm had carried away "
    "most of the old wooden piers. The new breakwater, designed by the engineer Marta "
    "Lindqvist, was made of granite blocks brought by rail from the quarries at Halden, "
    "each block weighing close to four tonnes. Work began in the spring and continued for "
    "three summers, employing more than two hundred men from the town and the farms around "
    "it. When the breakwater was finished it stretched 640 metres into the bay, and a small "
    "lighthouse with a red lamp was placed at its end. Fishing boats that had once waited "
    "outside the bay for the tide could now enter in any weather, and within ten years the "
    "number of boats registered at Elmsworth had doubled. The granite blocks are still "
    "visible today, although the lighthouse was replaced by an electric beacon in 1952.")
GARDEN = (
    "Every Saturday morning the community garden on Fenwick Street opens its gates at eight "
    "o'clock. Volunteers arrive with their own gloves and tools, and the coordinator, Daniel "
    "Okafor, hands out a list of jobs written on a small blackboard beside the shed. Some "
    "people water the raised beds of lettuce, beans and tomatoes, while others turn the "
    "compost heaps or repair the wooden fences that the wind has loosened during the week. "
    "At half past ten everyone stops for tea and bread baked by the bakery across the road, "
    "which gives the garden its leftover loaves. The vegetables that are ready for picking "
    "are packed into boxes and taken to the food bank on Mill Lane before noon. Last year "
    "the garden delivered 1,340 kilograms of vegetables, and this year the volunteers hope "
    "to reach 1,500 kilograms by planting a second row of potatoes along the north wall.")
BRIDGE = (
    "The old stone bridge over the river Arne has five arches and was finished in 1764. "
    "Travellers crossing the valley once paid a toll of two pennies at a small house on the "
    "eastern bank, where the toll keeper lived with his family. The bridge was widened in "
    "1903 so that two carts could pass each other, and iron railings were added on both "
    "sides. A mill stood just upstream, and its wheel turned day and night while there was "
    "enough water in the river. In the dry summer of 1921 the river almost stopped flowing "
    "and people walked across the riverbed beside the bridge. The mill closed in 1958 and its "
    "building became a museum about farming in the valley. Today the bridge carries only "
    "walkers and cyclists, since a concrete road bridge was built two kilometres to the "
    "south, and the toll house has become a café that sells ice cream in the summer.")
ORDER = (
    "Order number: 58213-KX\n"
    "Customer name: Priya Raman\n"
    "Delivery address: Flat 4, 27 Chestnut Avenue, Northfield, NF3 8QL\n"
    "Telephone: 0161 555 0187\n"
    "Items: two ceramic plant pots (large, glazed blue), one bag of potting compost (40 "
    "litres), one pair of garden gloves (size medium), three packets of sunflower seeds\n"
    "Payment: paid by card on 12 March, total 46.80 pounds\n"
    "Delivery notes: please leave the parcel with the neighbour at Flat 3 if nobody answers; "
    "the entrance is at the back of the building, through the green gate beside the bike "
    "shed, and the bell for Flat 4 does not work, so knock on the door\n"
    "Warehouse notes: pack the pots in separate boxes with extra paper, they broke last time")


def _chat(text: str) -> tuple:
    return ({"role": "user", "content": text},)


COPY_MIX = [
    Prompt("repeat_harbour", "repeat", _chat(
        "Repeat the following paragraph exactly, word for word, and write nothing else.\n\n"
        + HARBOUR)),
    Prompt("repeat_garden", "repeat", _chat(
        "Copy this text exactly as it is written:\n\n" + GARDEN)),
    Prompt("edit_bridge", "edit", _chat(
        "In the paragraph below, change the year 1764 to 1771. Return the whole paragraph "
        "with only that change.\n\n" + BRIDGE)),
    Prompt("edit_harbour", "edit", _chat(
        "Rewrite the paragraph below exactly, but replace the name Marta Lindqvist with "
        "Helena Brandt. Give the complete paragraph.\n\n" + HARBOUR)),
    Prompt("extract_order", "extract", _chat(
        "From the order below, copy out the customer name, the delivery address, the items "
        "and the delivery notes, exactly as written.\n\n" + ORDER)),
    Prompt("extract_bridge", "extract", _chat(
        "Copy out, word for word, every sentence of this text that mentions the bridge or "
        "the mill.\n\n" + BRIDGE)),
]
FREE_MIX = [
    Prompt("story_lighthouse", "story", _chat(
        "Write a short story about a lighthouse keeper who finds a message in a bottle.")),
    Prompt("story_robot", "story", _chat(
        "Tell a story about a small robot that wants to learn how to paint.")),
    Prompt("explain_vaccines", "explain", _chat(
        "Explain how vaccines train the immune system, in simple words.")),
    Prompt("explain_seasons", "explain", _chat(
        "Why does the Earth have seasons? Explain it to a twelve-year-old.")),
    Prompt("story_market", "story", _chat(
        "Write a story about a busy market day in a mountain village.")),
    Prompt("explain_bread", "explain", _chat(
        "Describe how bread rises and what yeast does in the dough.")),
]
MIXES = {"copy": COPY_MIX, "free": FREE_MIX}
WARMUP = [Prompt("warmup_tea", "warmup", _chat("How do I make a good cup of tea?")),
          Prompt("warmup_copy", "warmup", _chat(
              "Repeat exactly: the quick brown fox jumps over the lazy dog, twice."))]
