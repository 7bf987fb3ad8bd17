// jinja2 resolves variable names when it compiles a template, frame by frame (the template,
// each loop body, macro, {% with %}, block {% set %}, {% filter %}), and a few observable
// behaviors follow from that rather than from plain dynamic scoping. The one the
// interpreter cannot get by walking its scope chain: when the first thing a frame does with
// a name is to assign it outside any {% if %} (no earlier read in the frame, no enclosing
// frame that uses the name), the name starts *undefined* in that frame, so a loop, macro or
// block that runs before the assignment sees it undefined, even if the context defines it:
//
//   {% for m in messages %}{{ x }}{% endfor %}{% set x = 1 %}   -> x is undefined in the loop
//
// resolve_frames computes those names for every frame (Template::start_undefined,
// Stmt::frame_undefined / else_undefined), mirroring jinja2/idtracking.py; the interpreter
// binds them to undefined when it enters the frame.
#pragma once

#include "text/jinja/ast.h"

namespace kvlm::jinja {

void resolve_frames(Template& tpl);

}  // namespace kvlm::jinja
