// What jsdom lacks and Lumino's widgets expect at import time (drag and drop events).
// Imported first by the DOM tests.
const globals = globalThis as unknown as Record<string, unknown>;
if (typeof globals.DragEvent === 'undefined') {
  globals.DragEvent = class DragEvent extends MouseEvent {};
}
export {};
