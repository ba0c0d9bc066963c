"""How the bundled Shakespeare models were trained (`train`) and evaluated (`shakespeare`)."""
