"""The pure core: the graph, the state machine and its policies. Nothing here imports Ray."""
