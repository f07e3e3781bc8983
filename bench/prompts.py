"""Chat prompts shared by the benchmarks: input-grounded ones (the answer copies much of the
prompt: edit, rewrite, correct, summarise a given text), where n-gram drafting finds its
matches, and open-ended ones, where it finds few."""

TEXT = ("The river rose for three days. On the fourth morning the bridge was under water, the school was "
        "closed, and the baker on Mill Street handed out bread to anyone who came to his door. By evening "
        "the water had reached the steps of the town hall, where the mayor stood with a lantern and a list "
        "of names, counting the families who had not yet been seen.")
CODE = ("def mean(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
        "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n    total = 0\n"
        "    for value in values:\n        total = total + (value - m) ** 2\n    return total / len(values)\n")
GROUNDED = [
    f"Repeat the following text exactly, but write 'creek' instead of 'river':\n\n{TEXT}",
    f"Rewrite this Python code, renaming the variable 'total' to 'acc'. Output only the code.\n\n{CODE}",
    f"Correct the spelling in this text and output the corrected text:\n\n{TEXT.replace('the', 'teh')}",
    f"Summarise this text, quoting its most important sentence:\n\n{TEXT}",
]
OPEN = ["Write a short story about a lighthouse keeper.", "Explain how a refrigerator works.",
        "Give me ten tips for learning to cook.", "Describe a walk through a forest in autumn."]
