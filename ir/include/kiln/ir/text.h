// The .kir text format: printer and parser.
//
//   graph @mlp(%x: f32[B, 784], %w: f32[256, 784]) -> (f32[B, 256]) {
//     %h = linear(%x, %w) : f32[B, 256]
//     %y = relu(%h) : f32[B, 256]
//     return %y
//   }
//
// Printing the parse of a printer's output gives the same bytes.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"

namespace kiln {

struct PrintOptions {
  /// Tensors with more bytes than this go to the side file when one is given.
  size_t inline_limit_bytes = 1024;
  /// Path of the side file for large constants, written by print_graph_to_file; when empty
  /// every constant is printed inline.
  std::string side_file;
};

/// Prints `g` as .kir text. Large constants are always inline here.
std::string print_graph(const Graph& g);
/// Prints a single node (one line, regions included) for diagnostics.
std::string print_node(const Node& n);
/// Writes `g` to `path`; constants above opts.inline_limit_bytes go to opts.side_file
/// (a raw little-endian blob referenced by offset, path stored relative to `path`).
Status print_graph_to_file(const Graph& g, const std::string& path, const PrintOptions& opts);

/// Parses .kir text. `filename` is used in diagnostics ("file:line:col: expected ...") and
/// to resolve side files relative to its folder. The result is verified.
StatusOr<std::unique_ptr<Graph>> parse_graph(std::string_view text,
                                            const std::string& filename = "<input>");
/// Reads and parses a .kir file.
StatusOr<std::unique_ptr<Graph>> parse_graph_file(const std::string& path);

}  // namespace kiln
