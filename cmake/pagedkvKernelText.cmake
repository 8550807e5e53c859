# cmake -DIN=<header> -DOUT=<file> -P pagedkvKernelText.cmake
#
# Writes the kernel source that <header> holds as a raw string literal
# (R"PAGEDKV( ... )PAGEDKV", see include/pagedkv/cuda/source_text.hpp) to
# <file>, behind a #line directive naming the header's own lines, so that
# the tests' CPU emulator compiles the very text NVRTC compiles (and g++'s
# messages point into the header).
file(READ "${IN}" content)
string(FIND "${content}" "R\"PAGEDKV(" open)
string(FIND "${content}" ")PAGEDKV\"" close)
string(FIND "${content}" "R\"PAGEDKV(" open_last REVERSE)
if(open EQUAL -1 OR close EQUAL -1 OR NOT open EQUAL open_last OR close LESS open)
  message(FATAL_ERROR "${IN}: expected exactly one R\"PAGEDKV( ... )PAGEDKV\" kernel source")
endif()
string(SUBSTRING "${content}" 0 ${open} before)
string(REGEX MATCHALL "\n" newlines "${before}")
list(LENGTH newlines line)
math(EXPR line "${line} + 1")
math(EXPR start "${open} + 10")  # past R"PAGEDKV(
math(EXPR length "${close} - ${start}")
string(SUBSTRING "${content}" ${start} ${length} text)
file(WRITE "${OUT}.tmp" "#line ${line} \"${IN}\"\n${text}\n")
file(RENAME "${OUT}.tmp" "${OUT}")
