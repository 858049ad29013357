// The kir front end: reads Kiln's own text IR (.kir files).
#include "kiln/ir/text.h"
#include "kiln/plugin.h"

namespace {

kiln::Status register_kir_frontend(kiln::Registry& r) {
  kiln::FrontendInfo info;
  info.name = "kir";
  info.version = "0.1.0";
  info.summary = "Kiln text IR (.kir), as written by the printer";
  info.extensions = {".kir"};
  info.import = [](const std::string& path, const kiln::Options&) {
    return kiln::parse_graph_file(path);
  };
  return r.add_frontend(std::move(info));
}

}  // namespace

KILN_PLUGIN("kiln-frontend-kir", "0.1.0", register_kir_frontend)
