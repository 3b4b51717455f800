# perf/net_plugin_perf: the NCCL net plugin against fi_pingpong on the same
# provider (docs/NET_PLUGIN.md, "Performance").  Included from
# perf/CMakeLists.txt, so the binary lands in build/perf/ with the others.
add_executable(net_plugin_perf ${PROJECT_SOURCE_DIR}/perf/net_plugin_perf.cc)
target_link_libraries(net_plugin_perf PRIVATE kvxfer_perf_harness kvxfer_core CLI11::CLI11
                                              nlohmann_json::nlohmann_json ${CMAKE_DL_LIBS})
target_include_directories(net_plugin_perf PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/src)
target_compile_definitions(net_plugin_perf PRIVATE
  KVXFER_NET_PLUGIN_PATH="$<TARGET_FILE:nccl_net_kvxfer>")
add_dependencies(net_plugin_perf nccl_net_kvxfer)

# A short run with every byte checked (exit status 1 on any #wrong or failed
# transfer); the fi_pingpong columns read n/a where fabtests is missing.
if(KVXFER_BUILD_TESTS)
  add_test(NAME net_plugin_perf_check
    COMMAND net_plugin_perf -b 64 -e 256K -f 16 -w 1 -n 3 -c 1)
  set_tests_properties(net_plugin_perf_check PROPERTIES LABELS perf TIMEOUT 300)
endif()
