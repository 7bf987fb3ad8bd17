// JSON schemas as grammars: every text the grammar allows is a JSON value that validates
// against the schema. What is supported (anything else is refused, by keyword and path,
// rather than generated and left unchecked):
//   type (one or a list), enum, const, anyOf / oneOf, allOf of one schema, $ref into the
//   document ($defs, definitions: recursion allowed), nullable;
//   object: properties (generated in the schema's order, optional ones may be left out),
//     required, additionalProperties (false, true or a schema; when `properties` is given,
//     no other keys are generated);
//   array: items, prefixItems, minItems, maxItems;
//   string: minLength, maxLength (code points), pattern (regex.h, whole-string match),
//     format date / time / date-time / duration / uuid / email / hostname / ipv4 / ipv6;
//   integer: minimum, maximum, exclusiveMinimum, exclusiveMaximum (exact ranges);
//   number: the same four bounds (exact in decimal: every number written reads back, as a
//     double, within them).
// Numbers are written with at most 16 digits before and after the point and a 3-digit
// exponent (a double's precision and range); bounded ones without an exponent, with up to 16
// integer digits and up to 16 fraction digits, or as many as a bound has (at most 32);
// integers without a bound with at most 18 digits: every output stays valid, and a model
// cannot write digits until max_tokens.
// Annotations (title, description, default, examples, $schema, $id, $comment, deprecated,
// readOnly, writeOnly, strict) are ignored. Between tokens the grammar allows nothing, one
// space, or a line break and up to 24 tabs or spaces of indentation: compact and
// pretty-printed JSON, but no runs of blank lines a model could spin in until max_tokens.
#pragma once

#include <nlohmann/json.hpp>

#include "text/grammar/grammar.h"

namespace kvlm::grammar {

// Throws kvlm::Error naming the keyword and where it is (a JSON pointer).
Grammar json_schema_grammar(const nlohmann::ordered_json& schema);
// Any JSON object (response_format json_object).
Grammar json_object_grammar();

}  // namespace kvlm::grammar
