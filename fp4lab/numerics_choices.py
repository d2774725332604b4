"""The numerics layer's enumerated choices, in a module that imports nothing. It stands beside
fp4lab/numerics/ rather than in it because that package's __init__ imports torch, and
`fp4lab --help` lists these without importing torch."""

DISTRIBUTIONS = ("normal", "student-t", "outlier")  # the tensors fp4lab.numerics.survey synthesizes
