"""How much room there is: the usable budget, the model catalog (catalog.json), the budget policy."""
