# Included by CMake right after llama.cpp's project() (the Makefile's LLAMACPP_CMAKE_ARGS
# sets CMAKE_PROJECT_llama.cpp_INCLUDE to this file). llama-cpp-python's CMakeLists forces
# LLAMA_BUILD_COMMON ON in the cache, which compiles llama.cpp's common/ library and
# cpp-httplib (53 of 127 compile units, for llama.cpp's tools); the Python package never
# loads libcommon (it loads libllama, libggml* and, for multimodal models, libmtmd, which
# LLAVA_BUILD=OFF leaves out). A normal variable shadows that cache entry, so they are not
# built (measured: 74 compile units, about 270 s of CPU instead of 655 s).
set(LLAMA_BUILD_COMMON OFF)
