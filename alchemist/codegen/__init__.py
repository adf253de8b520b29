"""Codegen: ModelIR -> generated/<slug>.py (jinja2 templates under templates/, black, libcst)."""

from alchemist.codegen.render import BLACK_MODE, module_slug, py_literal, render_module

__all__ = ["BLACK_MODE", "module_slug", "py_literal", "render_module"]
