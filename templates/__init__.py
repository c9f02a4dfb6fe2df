"""Jinja2 templates shipped inside the wheel as attngen.templates."""
