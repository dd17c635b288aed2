"""The fixed inputs of the weight-quality bar (issue 28 item 3): a text to take perplexity on
(long enough that rounding noise does not move it past the bar) and the reference prompts.
tests/test_native_weights.py and bench/weight_quality.py both measure on them."""

TEXT = ("The sun rose over the quiet village. Farmers walked to their fields, children ran to"
        " school, and the baker opened his shop. By noon the market was full of people buying"
        " bread, fruit and fish. In the evening everyone gathered in the square to talk about"
        " the day, and the old clock in the tower struck eight as the lights came on."
        "\n\nThe river that ran past the village had shaped its life for centuries. In spring it"
        " flooded the low meadows and left behind a layer of dark soil, so the farmers planted"
        " late and harvested well. In summer the children swam in its shallow bends, and in"
        " autumn the fishermen set their nets where the water slowed behind the old stone"
        " bridge. Nobody remembered who had built the bridge, but every family had a story"
        " about it, and most of the stories did not agree."
        "\n\nOne winter a stranger arrived with a cart full of books. He rented the empty room"
        " above the bakery and opened a small library, charging nothing but asking each reader"
        " to bring back a story in exchange for every book they borrowed. At first only the"
        " teacher came, then a few of the older children, and by the end of the year half the"
        " village had written something down: recipes, songs, accounts of storms and weddings,"
        " and long letters to relatives who had moved to the city."
        "\n\nYears later, when the stranger had gone, the villagers found that the library had"
        " become a record of their own lives. Students from the university came to read it,"
        " and a historian wrote that no other place in the region had kept such a careful"
        " account of ordinary days. The baker's grandson still keeps the key, and on the first"
        " Sunday of every month he opens the door, lights the stove, and lets anyone who wants"
        " to read sit by the window until the evening bell."
        "\n\nScientists measure the speed of a chemical reaction by watching how quickly the"
        " reactants disappear or the products form. Temperature matters because molecules that"
        " move faster collide more often and with more energy, and a catalyst matters because"
        " it offers a path that needs less energy to cross. In a cell, enzymes play that role:"
        " each one binds a particular molecule, holds it in a shape that makes the reaction"
        " easy, and lets the product go, ready to do the same thing again thousands of times"
        " a second.")
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "How many legs does a spider have?",
                "Explain gravity to a child in one sentence.", "List three primary colors."]
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
