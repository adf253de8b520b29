"""Views of a model for people: one module per view.

- card        `alchemist card`: the architecture's block diagram and a component summary from the IR alone
              (no weights), or two models side by side with what differs
- layer_graph `alchemist graph`: one layer's PyTensor graph from the generated module, before and after a
              backend's rewrites, as a listing, Graphviz DOT or PNG
"""
