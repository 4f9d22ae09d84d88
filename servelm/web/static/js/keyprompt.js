// The API-key dialog both pages share: asked for on a 401, kept in localStorage.
import { getApiKey, setApiKey } from "./api.js";

/** Show the key dialog with `message`; resolves true when a key was saved, false when cancelled. */
export function askForKey(message) {
  const dialog = document.getElementById("key-dialog");
  const input = dialog.querySelector("input");
  dialog.querySelector(".key-message").textContent = message;
  input.value = getApiKey();
  return new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => {
        const saved = dialog.returnValue === "save" && input.value.trim() !== "";
        if (saved) setApiKey(input.value.trim());
        resolve(saved);
      },
      { once: true },
    );
    if (!dialog.open) dialog.showModal();
    input.focus();
  });
}
